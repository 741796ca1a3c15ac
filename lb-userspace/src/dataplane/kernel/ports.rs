//! Several interfaces (`dataplane.interfaces`): the one program attached to each, a link
//! pinned per interface (`pins::link_pin_of`), and the egress maps that tell the program
//! where a frame leaves (`LB_EGRESS`, the DEVMAP `LB_TX_PORTS`, `LB_BE_EGRESS`). The first
//! interface is attached by `attach_pinned`, as a single one is.

use std::path::Path;

use lb_common::{EgressInfo, MAP_BACKEND_EGRESS, MAP_EGRESS, MAX_EGRESS};

use super::{AyaDataplane, accepts};
use crate::config::XdpModeSetting;
use crate::dataplane::{
    AttachHints, AttachedMode, Attachment, DataplaneError, EgressPort, in_map,
    pins::{self, PinnedLinkState},
};

impl AyaDataplane {
    /// Records the `index`th interface for the program: where frames of its backends
    /// leave (`LB_EGRESS`, and the redirect target unless it is gone) and, for a
    /// restarted agent, the mode its link was attached in.
    pub fn record_egress(&mut self, index: u32, port: &EgressPort) -> Result<(), DataplaneError> {
        // Not attached yet (at start): the mode a previous agent recorded for this
        // interface stays, for `attach_more` to take its link over.
        let recorded = self
            .egress
            .get(&index, 0)
            .ok()
            .filter(|e| e.ifindex == port.ifindex)
            .map_or(0, |e| e.mode);
        let info = EgressInfo {
            ifindex: port.ifindex,
            mac: port.mac,
            mode: port.mode.map_or(recorded, |m| pins::mode_code(m) as u8),
            _pad: 0,
        };
        // The redirect target first: the program reads LB_EGRESS, then redirects.
        if port.ifindex != 0 {
            self.tx_ports
                .set(index, port.ifindex, None, 0)
                .map_err(|source| DataplaneError::TxPort {
                    index,
                    ifindex: port.ifindex,
                    source,
                })?;
        }
        self.egress.set(index, info, 0).map_err(in_map(MAP_EGRESS))
    }

    /// Attaches the program to the `index`th (not the first) of several interfaces as
    /// `attach_pinned` does to the first: onto the link a previous agent pinned for it,
    /// in one step (no frame sees no program), when that link is on this interface in a
    /// mode the configuration accepts; else afresh, its link pinned for the next agent.
    pub fn attach_more(
        &mut self,
        index: usize,
        interface: &str,
        ifindex: u32,
        mode: XdpModeSetting,
        hints: &AttachHints,
    ) -> Result<Attachment, DataplaneError> {
        let dir = self.pin_dir.clone().expect("attach_more after load_pinned");
        let link_path = dir.join(pins::link_pin_of(index, interface));
        if let Some(pinned) = self.pinned_port_mode(&link_path, ifindex)
            && accepts(mode, pinned)
        {
            self.take_over(&link_path)?;
            tracing::info!("{interface}: the program took over the pinned link ({pinned} mode)");
            return Ok(Attachment {
                mode: pinned,
                native_refused: None,
            });
        }
        self.attach_afresh(interface, mode, &link_path, hints)
    }

    /// The mode a previous agent attached interface `ifindex` in, when the link pinned at
    /// `link_path` is still on it and `LB_EGRESS` recorded the mode.
    fn pinned_port_mode(&self, link_path: &Path, ifindex: u32) -> Option<AttachedMode> {
        if pins::link_state_at(link_path) != (PinnedLinkState::Attached { ifindex }) {
            return None;
        }
        (0..MAX_EGRESS)
            .filter_map(|i| self.egress.get(&i, 0).ok())
            .find(|e| e.ifindex == ifindex)
            .and_then(|e| pins::mode_from_code(e.mode as u64))
    }

    /// `Dataplane::set_backend_egress` on the real map.
    pub(super) fn write_backend_egress(
        &mut self,
        id: u32,
        egress: u32,
    ) -> Result<(), DataplaneError> {
        self.backend_egress
            .set(id, egress, 0)
            .map_err(in_map(MAP_BACKEND_EGRESS))
    }
}
