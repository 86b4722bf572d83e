//! What of the `arena` strategy the pool reads without its books: the granules under an
//! exported block (`arena/export.rs`) and the figures the reports give (`arena/figures.rs`).
//! The arena's driver calls are the pool's: growth (`ArenaGrowth`, mapping windows and
//! stitches) in `grow.rs`, giving granules back and the teardown in `release.rs`. The
//! strategy plans and keeps the books; the pool makes every driver call and updates the
//! books after each that succeeded, so a failure midway leaves them exact.

mod export;
mod figures;

pub use figures::ArenaFigures;
pub(super) use export::{granule_count as export_granule_count, granules as export_granules};
