//! What of the `arena` strategy needs the core alone: the granules under an exported block
//! and their shareable handles (`arena/export.rs`, driver calls included) and the figures
//! the reports give (`arena/figures.rs`). The rest of the arena's driver calls are the
//! pool's: growth (`ArenaGrowth`, mapping windows and stitches) in `grow.rs`, giving
//! granules back and the teardown in `release.rs`. The strategy plans and keeps the books;
//! the pool makes every driver call and updates the books after each that succeeded, so a
//! failure midway leaves them exact.

pub(super) mod export;
mod figures;

pub use figures::ArenaFigures;
