"""The Python package's ctypes declarations against the C headers (runs everywhere, CI
included; no library is loaded): every function the package calls through ctypes is in its
table (`gpupool._signatures`), declared in include/ with the same number of arguments and
each passed as the header's type is, with the same result, and `gpupool.Stats` has
`struct gpupool_stats`'s fields in order. A header changed without the package (or the
reverse) fails here instead of passing wrong arguments at run time. The comparison is of
what crosses the call on Linux (ctypes' own types: `size_t` and `uint64_t` are one type
there, as are `char *` and `const char *`)."""
import ctypes
import pathlib
import re
import sys

from conftest import INSTALLED, ROOT

HEADERS = ("gpupool.h", "gpupool_share.h", "gpupool_plugin.h")


def _gpupool():
    if not INSTALLED and str(ROOT / "python") not in sys.path:
        sys.path.insert(0, str(ROOT / "python"))
    import gpupool
    return gpupool


def _code(text):
    """The header without comments and preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"^\s*#.*$", "", text, flags=re.M)


def parse(code):
    """[(result type, name, [parameter types])] of the gpupool_ functions `code` declares."""
    out = []
    for m in re.finditer(r"([A-Za-z_][\w \t\n\*]*?)\b(gpupool_\w+)\s*\(", code):
        # The parameters up to the matching parenthesis (a function pointer has its own).
        depth, i = 1, m.end()
        while depth and i < len(code):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        if not code[i:].lstrip().startswith(";"):
            continue   # a definition or a call, not a declaration
        params, part, depth = [], "", 0
        for ch in code[m.end():i - 1] + ",":
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                p = " ".join(part.split())
                part = ""
                if p in ("", "void"):
                    continue
                # A function pointer is passed as an address; otherwise a name, if any, goes.
                params.append("void *" if "(*" in p else _unnamed(p))
            else:
                part += ch
        out.append((" ".join(m.group(1).split()), m.group(2), params))
    return out


def _type(c):
    """`c` with one spelling: no `const`, one space before each `*`."""
    stars = re.sub(r"\s*\*\s*", "*", " ".join(c.replace("const ", "").split()))
    return re.sub(r"(?<=[^\s*])\*", " *", stars).strip()


def _unnamed(p):
    """The type of parameter `p`, its name (if it has one) left out."""
    t = _type(p)
    if t.endswith("*") or t in SCALARS:
        return t
    return re.sub(r"\b\w+$", "", t).strip()


def raw_declarations():
    """{name: [parameter text as written]} of every gpupool_ function in include/ (whether
    a pointer is `const`)."""
    out = {}
    for h in HEADERS:
        code = _code((ROOT / "include" / h).read_text())
        for m in re.finditer(r"\b(gpupool_\w+)\s*\(([^;]*?)\)\s*;", code):
            out[m.group(1)] = [" ".join(p.split()) for p in m.group(2).split(",")]
    return out


def declarations():
    """{name: (result type, [parameter types])} of every gpupool_ function in include/."""
    return {name: (ret, params) for h in HEADERS for ret, name, params in parse(_code((ROOT / "include" / h).read_text()))}


SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "unsigned": ctypes.c_uint,
    "unsigned int": ctypes.c_uint,
    "enum gpupool_status": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "ptrdiff_t": ctypes.c_ssize_t,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "int64_t": ctypes.c_int64,
    "double": ctypes.c_double,
}


def ctype_of(c, stats):
    """The ctypes type a C type is passed as (None: `void`)."""
    c = _type(c)
    if c.endswith("*"):
        inner = c[:-1].strip()
        if inner == "char":
            return ctypes.c_char_p
        if inner == "void":
            return ctypes.c_void_p
        return ctypes.POINTER(ctype_of(inner, stats))
    if c == "struct gpupool_stats":
        return stats
    return SCALARS[c]


def test_the_parser_reads_a_declaration():
    # What the checks below rest on: a multi-line declaration with pointers of two levels, and
    # one taking a function pointer.
    code = _code("/* x */ enum gpupool_status gpupool_f(int **out,\n  const char *name); // y\n"
                 "void gpupool_g(ptrdiff_t (*getter)(void));\nint gpupool_h(void*, size_t, const void *p);")
    assert parse(code) == [("enum gpupool_status", "gpupool_f", ["int **", "char *"]),
                           ("void", "gpupool_g", ["void *"]),
                           ("int", "gpupool_h", ["void *", "size_t", "void *"])]
    assert ctype_of("int **", None) is ctypes.POINTER(ctypes.POINTER(ctypes.c_int))
    assert ctype_of("const char *", None) is ctypes.c_char_p


def test_every_function_the_package_calls_is_in_its_table():
    gp = _gpupool()
    table = {name for name, _, _ in gp._signatures()}
    package = pathlib.Path(gp.__file__).parent
    called = set()
    for f in package.glob("*.py"):
        # Attribute calls on the loaded library (`lib().gpupool_x(`, `L.gpupool_x(`).
        called |= set(re.findall(r"\.(gpupool_\w+)\(", f.read_text()))
    assert len(called) > 30, sorted(called)
    assert called <= table, sorted(called - table)


def test_every_function_the_package_declares_matches_its_header():
    gp = _gpupool()
    declared = declarations()
    raw = raw_declarations()
    assert len(declared) > 50, sorted(declared)
    assert len(gp._signatures()) > 50
    wrong = []
    for name, res, args in gp._signatures():
        if name not in declared:
            wrong.append(f"{name}: declared in Python, in no header")
            continue
        ret, params = declared[name]
        want_res = ctype_of(ret, gp.Stats)
        want_args = [ctype_of(p, gp.Stats) for p in params]
        if res is not want_res:
            wrong.append(f"{name}: result {res} in Python, {ret} ({want_res}) in the header")
        if len(args) != len(want_args):
            wrong.append(f"{name}: {len(args)} arguments in Python, {len(want_args)} in the header ({params})")
            continue
        for i, (got, want, c) in enumerate(zip(args, want_args, params)):
            # Bytes the C side only reads (a descriptor) go in as `bytes`: c_char_p passes the
            # buffer's address, embedded zeros included, as c_void_p would.
            if got is ctypes.c_char_p and c == "void *" and "const" in raw[name][i]:
                continue
            if got is not want:
                wrong.append(f"{name}: argument {i} is {got} in Python, {c} ({want}) in the header")
    assert not wrong, "\n".join(wrong)


def test_the_stats_structure_has_the_headers_fields_in_order():
    gp = _gpupool()
    body = re.search(r"struct gpupool_stats\s*\{(.*?)\}", _code((ROOT / "include" / "gpupool.h").read_text()), re.S)
    assert body, "struct gpupool_stats not found in gpupool.h"
    fields = [(m.group(2), ctype_of(m.group(1), None)) for m in re.finditer(r"(\w+)\s+(\w+)\s*;", body.group(1))]
    assert [(n, t) for n, t in gp.Stats._fields_] == fields
