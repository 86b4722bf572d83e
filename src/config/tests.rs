//! Unit tests of `config`: parsing values and the environment through `Config::from_lookup`.

use super::*;
use super::unknown::edit_distance;
use std::collections::HashMap;

fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Config::from_lookup(|k| m.get(k).cloned())
}

#[test]
fn sizes_parse() {
    assert_eq!(parse_size("1073741824"), Some(1 << 30));
    assert_eq!(parse_size("512MiB"), Some(512 << 20));
    assert_eq!(parse_size("8GiB"), Some(8 << 30));
    assert_eq!(parse_size("8GB"), Some(8_000_000_000));
    assert_eq!(parse_size("8 gib"), Some(8 << 30));
    assert_eq!(parse_size("1.5GiB"), Some(3 << 29));
    assert_eq!(parse_size("0.3B"), None);
    assert_eq!(parse_size("-1"), None);
    assert_eq!(parse_size("12XB"), None);
    assert_eq!(parse_size(""), None);
    assert_eq!(parse_size("99999999999999999999999TiB"), None);
}

#[test]
fn limits_parse() {
    assert_eq!(parse_limit("50%"), Some(LimitSpec::Percent(50.0)));
    assert_eq!(parse_limit("150%"), None);
    assert_eq!(parse_limit("0%"), None);
    assert_eq!(LimitSpec::Percent(50.0).resolve(1000), 500);
    assert_eq!(parse_limit("2KiB"), Some(LimitSpec::Bytes(2048)));
}

#[test]
fn malformed_values_name_variable_value_and_accepted() {
    let e = cfg(&[("GPUPOOL_POOL", "fancy")]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("GPUPOOL_POOL") && msg.contains("fancy") && msg.contains("split | binned | none | arena"), "{msg}");
    let e = cfg(&[("GPUPOOL_MEMORY_LIMIT", "lots")]).unwrap_err();
    assert!(e.to_string().contains("GPUPOOL_MEMORY_LIMIT") && e.to_string().contains("50%"));
    // A bare unit letter is decimal, as its two-letter form, and the message says so.
    assert!(e.to_string().contains("K/M/G/T and KB/MB/GB/TB are powers of 1000"), "{e}");
    assert_eq!(parse_size("8G"), parse_size("8GB"));
    assert!(cfg(&[("GPUPOOL_UPSTREAM", "tpu")]).is_err());
    assert!(cfg(&[("GPUPOOL_DEBUG", "3")]).is_err());
    assert!(cfg(&[("GPUPOOL_UNSAFE_IGNORE_STREAMS", "maybe")]).is_err());
    assert!(cfg(&[("GPUPOOL_THREAD_CACHE", "sometimes")]).is_err());
    assert!(!cfg(&[("GPUPOOL_THREAD_CACHE", "0")]).unwrap().thread_cache);
    assert_eq!(cfg(&[]).unwrap().event_batch, EVENT_BATCH);
    assert!(cfg(&[]).unwrap().arena_lend);
    assert!(!cfg(&[("GPUPOOL_ARENA_LEND", "0")]).unwrap().arena_lend);
    assert!(cfg(&[("GPUPOOL_ARENA_LEND", "maybe")]).is_err());
    assert!(!cfg(&[]).unwrap().arena_piece_ends, "piece ends are off by default");
    assert!(cfg(&[("GPUPOOL_ARENA_PIECE_ENDS", "1")]).unwrap().arena_piece_ends);
    assert!(cfg(&[("GPUPOOL_ARENA_PIECE_ENDS", "sometimes")]).is_err());
    assert_eq!(cfg(&[]).unwrap().arena_chunk, 256 << 20);
    assert_eq!(cfg(&[("GPUPOOL_ARENA_CHUNK", "0")]).unwrap().arena_chunk, 0);
    assert_eq!(cfg(&[("GPUPOOL_ARENA_CHUNK", "64MiB")]).unwrap().arena_chunk, 64 << 20);
    assert!(cfg(&[("GPUPOOL_ARENA_CHUNK", "big")]).is_err());
    assert_eq!(cfg(&[]).unwrap().arena_chunk_from, 64 << 20);
    assert_eq!(cfg(&[("GPUPOOL_ARENA_CHUNK_FROM", "8MiB")]).unwrap().arena_chunk_from, 8 << 20);
    assert!(cfg(&[("GPUPOOL_ARENA_CHUNK_FROM", "soon")]).is_err());
    assert_eq!(cfg(&[("GPUPOOL_EVENT_BATCH", " 1 ")]).unwrap().event_batch, 1);
    assert_eq!(cfg(&[]).unwrap().event_batch_bytes, EVENT_BATCH_BYTES);
    assert_eq!(cfg(&[("GPUPOOL_EVENT_BATCH_BYTES", "256MiB")]).unwrap().event_batch_bytes, 256 << 20);
    for bad in ["0", "-1", "lots", "1.5x"] {
        assert!(cfg(&[("GPUPOOL_EVENT_BATCH_BYTES", bad)]).is_err(), "{bad:?} accepted");
    }
    assert_eq!(cfg(&[]).unwrap().stream_shards, STREAM_SHARDS);
    assert_eq!(cfg(&[("GPUPOOL_STREAM_SHARDS", " 0 ")]).unwrap().stream_shards, 0);
    for bad in ["33", "-1", "x", ""] {
        assert!(cfg(&[("GPUPOOL_STREAM_SHARDS", bad)]).is_err(), "{bad:?} accepted");
    }
    for bad in ["0", "-3", "lots", "5000", ""] {
        assert!(cfg(&[("GPUPOOL_EVENT_BATCH", bad)]).is_err(), "{bad:?} accepted");
    }
    assert!(cfg(&[("GPUPOOL_ARENA_VA", "-3")]).is_err());
    assert!(cfg(&[("GPUPOOL_ARENA_VA", "0")]).is_err());
    let e = cfg(&[("GPUPOOL_ARENA_VA", "1KB")]).unwrap_err().to_string();
    assert!(e.contains("GPUPOOL_ARENA_VA") && e.contains("\"1KB\"") && e.contains("at least 2MiB"), "{e}");
    assert_eq!(cfg(&[("GPUPOOL_ARENA_VA", "2MiB")]).unwrap().arena_va, Some(2 << 20));
    assert_eq!(cfg(&[("GPUPOOL_ARENA_VA", "64GiB")]).unwrap().arena_va, Some(64 << 30));
    assert_eq!(cfg(&[("GPUPOOL_POOL", "arena")]).unwrap().pool, PoolKind::Arena);
    assert_eq!(cfg(&[]).unwrap().pool, PoolKind::Arena, "the arena is the default");
    assert_eq!(cfg(&[("GPUPOOL_POOL", "split")]).unwrap().pool, PoolKind::Split);
}

#[test]
fn unknown_variables_are_named_once_with_the_setting_meant() {
    let env = |v: &[&str]| unknown_variables(v.iter().map(|s| s.to_string()));
    assert_eq!(env(&["GPUPOOL_LIMIT", "PATH", "GPUPOOL_POOL", "GPUPOOL_LIMIT"]), vec![("GPUPOOL_LIMIT".to_string(), "GPUPOOL_MEMORY_LIMIT")]);
    let near = |n: &str| env(&[n])[0].1;
    assert_eq!(near("GPUPOOL_POLL"), "GPUPOOL_POOL");
    assert_eq!(near("GPUPOOL_MEM_LIMIT"), "GPUPOOL_MEMORY_LIMIT");
    assert_eq!(near("GPUPOOL_EVENTBATCH"), "GPUPOOL_EVENT_BATCH");
    assert_eq!(near("GPUPOOL_THREADCACHE"), "GPUPOOL_THREAD_CACHE");
    assert_eq!(near("GPUPOOL_ARENA_LENDING"), "GPUPOOL_ARENA_LEND");
    assert_eq!(near("GPUPOOL_upstream"), "GPUPOOL_UPSTREAM");
    assert_eq!(near("GPUPOOL_TORCH_ALLOCATORS"), "GPUPOOL_TORCH_ALLOCATOR");
    // The project's own names, the library's and the others, are never warned about.
    assert!(env(&VARIABLES).is_empty());
    assert!(env(&OTHER_VARIABLES).is_empty());
    assert_eq!(edit_distance("kitten", "sitting"), 3);
}

#[test]
fn defaults_and_values() {
    let c = cfg(&[]).unwrap();
    assert_eq!(c, Config::default());
    let c = cfg(&[("GPUPOOL_POOL", "Binned"), ("GPUPOOL_UPSTREAM", "host"), ("GPUPOOL_MEMORY_LIMIT", "50%")]).unwrap();
    assert_eq!(c.pool, PoolKind::Binned);
    assert_eq!(c.upstream, UpstreamKind::Host);
    assert_eq!(c.limit, Some(LimitSpec::Percent(50.0)));
}

#[test]
fn error_texts_name_the_defaults_the_code_uses() {
    // An accepted-values text is a string literal; this keeps it from drifting from the
    // constant it names.
    let text = |var: &str| cfg(&[(var, "nonsense")]).unwrap_err().to_string();
    assert!(text("GPUPOOL_EVENT_BATCH").contains(&format!("default {EVENT_BATCH}")), "{}", text("GPUPOOL_EVENT_BATCH"));
    assert!(text("GPUPOOL_EVENT_BATCH_BYTES").contains(&format!("default {}MiB", EVENT_BATCH_BYTES >> 20)), "{}", text("GPUPOOL_EVENT_BATCH_BYTES"));
    let shards = text("GPUPOOL_STREAM_SHARDS");
    assert!(shards.contains(&format!("to {MAX_STREAM_SHARDS}; default {STREAM_SHARDS}")), "{shards}");
    assert_eq!(Config::default().event_batch, EVENT_BATCH);
    assert_eq!(Config::default().event_batch_bytes, EVENT_BATCH_BYTES);
    assert_eq!(Config::default().stream_shards, STREAM_SHARDS);
}
