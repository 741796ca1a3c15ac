//! A slot's word in `LB_MAGLEV` for a VIP with `VIP_F_STABLE` (`stable_slots`), as in
//! Beamer and Faild: what a table change moved is told apart from what it did not, so
//! only flows in moved slots need connection-table entries.
//!
//! The low 16 bits name the slot's backend (`NONE_16` for none). The high 16 bits are 0
//! for a *stable* slot, which no table change touched for longer than flows stay idle
//! (`dataplane.flow_idle_timeout`) and where no live entry names another backend: every
//! TCP packet of its flows goes where the table says, with no lookup and no entry. Else
//! they hold the slot's *previous* backend plus one: the backend of the slot's last
//! stable era, where a flow with no entry that is not new (no entry, no SYN, no
//! embryonic record) goes, to be pinned there by an entry at its second packet. The
//! agent writes the words (`TableWriter`) and turns a changed slot stable again after
//! a scan of the connection table. Other VIPs' slots hold plain backend ids.

use crate::{BACKEND_NONE, VIP_F_STABLE};

/// The low half of a word that names no backend.
pub const NONE_16: u32 = 0xffff;

/// Backend ids a word can name: below `NONE_16`.
pub const MAX_ID: u32 = NONE_16 - 1;

/// What a slot says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The table's backend (`BACKEND_NONE` for none).
    pub backend_id: u32,
    /// None: the slot is stable. Some: a recent change moved it; entry-less flows that
    /// are not new go to this backend (while it serves the VIP).
    pub previous: Option<u32>,
}

impl Slot {
    /// A slot no recent change touched.
    pub const fn stable(backend_id: u32) -> Self {
        Self {
            backend_id,
            previous: None,
        }
    }
}

/// The word of `slot`, for a VIP with `VIP_F_STABLE`. Ids above `MAX_ID` are not
/// representable (the agent refuses `stable_slots` with `max_backends` above 65,535).
pub const fn word(slot: Slot) -> u32 {
    let low = if slot.backend_id == BACKEND_NONE {
        NONE_16
    } else {
        slot.backend_id & NONE_16
    };
    let high = match slot.previous {
        Some(previous) if previous != BACKEND_NONE => (previous & NONE_16) + 1,
        _ => 0,
    };
    high << 16 | low
}

/// What `word` says for a VIP of `flags`: plain backend ids, always stable, unless the
/// VIP has `VIP_F_STABLE`.
#[inline(always)]
pub const fn read(word: u32, flags: u32) -> Slot {
    if flags & VIP_F_STABLE == 0 {
        return Slot::stable(word);
    }
    let low = word & NONE_16;
    let high = word >> 16;
    Slot {
        backend_id: if low == NONE_16 { BACKEND_NONE } else { low },
        previous: if high == 0 { None } else { Some(high - 1) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_says_what_was_written() {
        for slot in [
            Slot::stable(0),
            Slot::stable(7),
            Slot::stable(BACKEND_NONE),
            Slot::stable(MAX_ID),
            Slot {
                backend_id: 3,
                previous: Some(0),
            },
            Slot {
                backend_id: BACKEND_NONE,
                previous: Some(MAX_ID),
            },
            Slot {
                backend_id: 0,
                previous: Some(9),
            },
        ] {
            assert_eq!(read(word(slot), VIP_F_STABLE), slot, "{slot:?}");
        }
    }

    #[test]
    fn other_vips_read_plain_ids() {
        assert_eq!(read(5, 0), Slot::stable(5));
        assert_eq!(read(BACKEND_NONE, 0), Slot::stable(BACKEND_NONE));
        // A stable slot's word is the plain id: a table written without marks reads the
        // same either way.
        assert_eq!(word(Slot::stable(5)), 5);
    }
}
