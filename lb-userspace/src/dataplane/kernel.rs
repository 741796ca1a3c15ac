//! `AyaDataplane`: the program loaded into the kernel, attached to an interface,
//! adopting what a previous agent pinned, and the `Dataplane` trait over its maps.

use std::{
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, DevMap, HashMap as BpfHashMap, IterableMap, MapData, PerCpuArray, PerCpuHashMap,
    },
    programs::{Xdp, XdpMode, xdp::XdpLinkId},
};
use lb_common::{
    BackendIdentity, BackendInfo, EgressInfo, Embryo, FlowEntry, FlowKey, GLOBAL_CAPTURE_RATE,
    GLOBAL_CT_INSERT_LIMIT, GLOBAL_IFACE_MAC, GLOBAL_MAGLEV_SIZE, GLOBAL_UDP_IDLE_NS,
    MAP_BACKEND_EGRESS, MAP_BACKEND_IDS, MAP_BACKEND_STATS, MAP_BACKENDS, MAP_CAPTURE,
    MAP_CONNTRACK, MAP_EGRESS, MAP_EGRESS_STATS, MAP_EMBRYONIC, MAP_EXPORT, MAP_HOT_SOURCES,
    MAP_MAGLEV, MAP_META, MAP_NEXT, MAP_QUIC_IDS, MAP_QUIC_STATS, MAP_SOURCES, MAP_STATS,
    MAP_TUNNEL, MAP_TX_PORTS, MAP_VIP_SLOTS, MAP_VIP_STATS, MAP_VIPS, Outcomes, PacketCounters,
    SourceKey, TABLE_GENERATIONS, TrafficCounters, TunnelConfig, VipInfo, VipKey,
    quic::{QuicCounters, ServerKey},
    stat,
};

use super::{
    Adopted, AttachHints, AttachTarget, AttachedMode, Attachment, CounterReader, Counters,
    Dataplane, DataplaneError, EgressPort, FlowLookups, FlowReader, FlowWriter, Found, LoadOptions,
    attach,
    batch::update_batch,
    counters::CounterMaps,
    dup_map, in_map,
    next::{self, NextProgram},
    pins::{self, LINK_PIN, PINNED_MAPS},
    remove_pins,
    slots::Vips,
    syscall_error,
};
use crate::config::XdpModeSetting;

mod ports;

/// The maps sized by `dataplane.max_backends` (one entry per backend id at most).
const BACKEND_MAPS: [&str; 5] = [
    MAP_BACKENDS,
    MAP_BACKEND_IDS,
    MAP_BACKEND_STATS,
    MAP_BACKEND_EGRESS,
    MAP_QUIC_IDS,
];

/// How long a link whose pin was removed may take to leave its interface before an
/// attach in its place gives up (the kernel frees a released link deferred).
const LINK_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The real data path: the program loaded into the kernel and its maps.
pub struct AyaDataplane {
    // Dropping `Ebpf` detaches the program and frees the maps; keep it for our lifetime.
    ebpf: Ebpf,
    /// `LB_VIPS` and `LB_VIP_SLOTS`.
    vips: Vips,
    maglev: Array<MapData, u32>,
    backends: Array<MapData, BackendInfo>,
    stats: PerCpuArray<MapData, Outcomes>,
    vip_stats: PerCpuArray<MapData, PacketCounters>,
    backend_stats: PerCpuArray<MapData, TrafficCounters>,
    conntrack: BpfHashMap<MapData, FlowKey, FlowEntry>,
    embryonic: Array<MapData, Embryo>,
    sources: PerCpuHashMap<MapData, SourceKey, u64>,
    /// Not pinned: the agent writes it afresh every sample, so a restarted agent's
    /// program starts without hot sources and has them again within a few samples.
    hot_sources: BpfHashMap<MapData, SourceKey, u32>,
    /// Not pinned, as `hot_sources`: the agent's first apply writes every server ID.
    quic_ids: BpfHashMap<MapData, ServerKey, u32>,
    /// Not pinned: QUIC counters start from zero with each program.
    quic_stats: PerCpuArray<MapData, QuicCounters>,
    identities: Array<MapData, BackendIdentity>,
    tunnel: Array<MapData, TunnelConfig>,
    meta: Array<MapData, u64>,
    /// The interfaces frames leave by (`LB_EGRESS`, `LB_TX_PORTS`), which backend takes
    /// which (`LB_BE_EGRESS`) and what left by each (`LB_EGRESS_STATS`).
    egress: Array<MapData, EgressInfo>,
    tx_ports: DevMap<MapData>,
    backend_egress: Array<MapData, u32>,
    egress_stats: PerCpuArray<MapData, PacketCounters>,
    /// Where the maps and the link are pinned, if they are.
    pin_dir: Option<PathBuf>,
    /// The options in force (adopted pins may have a larger VIP capacity than asked).
    options: LoadOptions,
    /// The mode of a pinned link on this interface that the program can take over.
    link_mode: Option<AttachedMode>,
    /// When incompatible pins were replaced: the backends the old program served.
    previous: Option<Adopted>,
    /// Whether the kernel takes batch map updates (BPF_MAP_UPDATE_BATCH).
    batch_writes: bool,
    /// The debug capture's ring, once `take_capture` gave it away: a program loaded by
    /// `follow_interface` must write into the same ring.
    capture: Option<MapData>,
    /// The cluster's export ring, once `take_export` gave it away (as `capture`).
    export: Option<MapData>,
}

impl AyaDataplane {
    /// Loads (not attaches) the `lb_xdp` program from `object`, with maps of its own.
    pub fn load(object: &[u8], options: LoadOptions) -> Result<Self, DataplaneError> {
        let mut dataplane = Self::load_with(object, options, None)?;
        dataplane.vips.mend()?;
        Ok(dataplane)
    }

    /// Loads the program with its maps pinned in `dir`, adopting what a previous agent
    /// left there when it is of this layout and these sizes, and replacing it otherwise.
    pub fn load_pinned(
        object: &[u8],
        options: LoadOptions,
        dir: &Path,
    ) -> Result<(Self, Found), DataplaneError> {
        let mut options = options;
        let mut previous = None;
        // A link whose interface went away while no agent ran cannot take a program
        // ("Link has been severed"): a new one replaces it. The maps it served are
        // independent of it: kept when their layout matches, whatever interface they
        // were recorded for (that one is gone).
        let defunct = pins::pinned_link_state(dir) == pins::PinnedLinkState::Defunct;
        if defunct {
            tracing::warn!(
                "the link pinned in {} is defunct (its interface went away while the agent \
                 was stopped): replacing it with a new link on this interface; the pinned \
                 maps are kept where their layout matches",
                dir.display()
            );
            pins::remove_link_pin(&dir.join(pins::LINK_PIN))?;
        }
        let link_mode = pins::pinned_link_mode(dir, &options);
        let found = pins::inspect_pins(dir, &mut options, defunct);
        if let Found::Incompatible(_) = found {
            if link_mode.is_some() {
                // The backends the running program serves (ids, MACs, serving state), read
                // through the old maps while they are still pinned, so the new tables are
                // not empty while health checks start again. Unreadable (another layout):
                // backends start as a fresh agent's do.
                // Loaded at the pinned maps' backend capacity, so every old id is read.
                let pinned = LoadOptions {
                    max_backends: pins::pinned_backend_capacity(dir)
                        .unwrap_or(options.max_backends),
                    ..options
                };
                previous = Self::load_with(object, pinned, Some(dir))
                    .and_then(|old| old.adopted(0))
                    .ok()
                    .map(|adopted| Adopted {
                        backends: adopted.backends,
                        freed: adopted.freed,
                        ..Adopted::default()
                    });
                // New maps, same link: `attach_pinned` swaps the new program onto it, so
                // the interface is never without a program (nor the host's program
                // behind it: `LB_NEXT` stays pinned until then).
                pins::remove_map_pins_for_takeover(dir)?;
            } else {
                remove_pins(dir)?;
            }
        }
        std::fs::create_dir_all(dir).map_err(|source| DataplaneError::Pin {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut dataplane = Self::load_with(object, options, Some(dir))?;
        dataplane.vips.mend()?;
        dataplane.link_mode = link_mode;
        dataplane.previous = previous;
        if !matches!(found, Found::Compatible(_)) {
            pins::write_meta(&mut dataplane.meta, &dataplane.options, None)?;
        }
        Ok((dataplane, found))
    }

    fn load_with(
        object: &[u8],
        options: LoadOptions,
        pins: Option<&Path>,
    ) -> Result<Self, DataplaneError> {
        let mut ebpf = Self::load_program(object, &options, pins, None)?;
        let vips = Vips::new(
            take_map(&mut ebpf, MAP_VIPS)?,
            take_map(&mut ebpf, MAP_VIP_SLOTS)?,
        )?;
        let dataplane = Self {
            vips,
            maglev: take_map(&mut ebpf, MAP_MAGLEV)?,
            backends: take_map(&mut ebpf, MAP_BACKENDS)?,
            stats: take_map(&mut ebpf, MAP_STATS)?,
            vip_stats: take_map(&mut ebpf, MAP_VIP_STATS)?,
            backend_stats: take_map(&mut ebpf, MAP_BACKEND_STATS)?,
            conntrack: take_map(&mut ebpf, MAP_CONNTRACK)?,
            embryonic: take_map(&mut ebpf, MAP_EMBRYONIC)?,
            sources: take_map(&mut ebpf, MAP_SOURCES)?,
            hot_sources: take_map(&mut ebpf, MAP_HOT_SOURCES)?,
            quic_ids: take_map(&mut ebpf, MAP_QUIC_IDS)?,
            quic_stats: take_map(&mut ebpf, MAP_QUIC_STATS)?,
            identities: take_map(&mut ebpf, MAP_BACKEND_IDS)?,
            tunnel: take_map(&mut ebpf, MAP_TUNNEL)?,
            meta: take_map(&mut ebpf, MAP_META)?,
            egress: take_map(&mut ebpf, MAP_EGRESS)?,
            tx_ports: take_map(&mut ebpf, MAP_TX_PORTS)?,
            backend_egress: take_map(&mut ebpf, MAP_BACKEND_EGRESS)?,
            egress_stats: take_map(&mut ebpf, MAP_EGRESS_STATS)?,
            pin_dir: pins.map(Path::to_path_buf),
            options,
            link_mode: None,
            previous: None,
            batch_writes: true,
            capture: None,
            export: None,
            ebpf,
        };
        Ok(dataplane)
    }

    /// Loads `lb_xdp` from `object` with `options`: with the maps pinned in `pins` (made
    /// there when missing), and with the maps of this instance pinned in `instance`
    /// (`follow_interface`: a second program on this one's maps).
    fn load_program(
        object: &[u8],
        options: &LoadOptions,
        pins: Option<&Path>,
        instance: Option<(&Path, &[String])>,
    ) -> Result<Ebpf, DataplaneError> {
        if object.is_empty() {
            return Err(DataplaneError::NoObject);
        }
        let maglev_entries = options.vip_capacity * TABLE_GENERATIONS * options.maglev_table_size;
        let udp_idle_ns = options.flow_idle.as_nanos().min(u64::MAX as u128) as u64;
        let cluster_export = u32::from(options.cluster_export);
        let mut loader = EbpfLoader::new();
        loader
            .override_global(GLOBAL_MAGLEV_SIZE, &options.maglev_table_size, true)
            .override_global(GLOBAL_IFACE_MAC, &options.iface_mac, true)
            .override_global(GLOBAL_UDP_IDLE_NS, &udp_idle_ns, true)
            .override_global(
                GLOBAL_CT_INSERT_LIMIT,
                &options.conntrack_insert_limit,
                true,
            )
            .override_global(GLOBAL_CAPTURE_RATE, &options.capture_rate, true)
            .override_global(lb_common::GLOBAL_CLUSTER_EXPORT, &cluster_export, true)
            .override_global(
                lb_common::GLOBAL_SOURCE_SAMPLE,
                &options.source_sample,
                true,
            )
            .override_global(lb_common::GLOBAL_EGRESS_COUNT, &options.egress_count, true)
            .map_max_entries(MAP_MAGLEV, maglev_entries)
            .map_max_entries(MAP_CONNTRACK, options.conntrack_entries);
        // Every map indexed or keyed by backend id; the program only looks them up, so
        // the kernel's bounds check against the loaded size is the only one.
        for name in BACKEND_MAPS {
            loader.map_max_entries(name, options.max_backends);
        }
        if let Some(dir) = pins {
            for name in PINNED_MAPS {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        if let Some((dir, names)) = instance {
            for name in names {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader.load(object)?;
        let program: &mut Xdp = ebpf
            .program_mut(options.program)
            .ok_or(aya::programs::ProgramError::NotLoaded)
            .and_then(|p| p.try_into())
            .map_err(lb_xdp_error)?;
        super::load_program(program).map_err(lb_xdp_error)?;
        Ok(ebpf)
    }

    /// After replacing incompatible pins: the backends the replaced program served.
    pub fn previous(&self) -> Option<&Adopted> {
        self.previous.as_ref()
    }

    /// The options in force: as asked, except a larger VIP capacity adopted from pins.
    pub fn options(&self) -> &LoadOptions {
        &self.options
    }

    /// Reads back what adopted maps hold: VIPs, backends in use and each VIP's live table.
    pub fn adopted(&self, table_size: u32) -> Result<Adopted, DataplaneError> {
        let mut adopted = Adopted {
            vips: self.vips.read()?,
            ..Adopted::default()
        };
        for id in 0..self.options.max_backends {
            let identity = self
                .identities
                .get(&id, 0)
                .map_err(in_map(MAP_BACKEND_IDS))?;
            if identity.in_use == 1 {
                let info = self.backends.get(&id, 0).map_err(in_map(MAP_BACKENDS))?;
                let egress = self
                    .backend_egress
                    .get(&id, 0)
                    .map_err(in_map(MAP_BACKEND_EGRESS))?;
                adopted.egress.insert(id, egress);
                adopted.backends.push((id, info, identity));
            } else if identity.addr != [0; 16] {
                adopted.freed.push(id);
            }
        }
        for (_, info) in &adopted.vips {
            let base = info.table_base(table_size);
            let table = (base..base + table_size)
                .map(|slot| self.maglev.get(&slot, 0).map_err(in_map(MAP_MAGLEV)))
                .collect::<Result<Vec<u32>, _>>()?;
            adopted.tables.push((info.vip_id, table));
        }
        Ok(adopted)
    }

    /// Attaches to `interface` and pins the link next to the maps, so the program stays
    /// attached after this process exits. When `found` is a compatible pinned state, the
    /// new program replaces the old one on its link in one step: no packet sees no
    /// program. An error says what the kernel's refusal means here (`hints`).
    pub fn attach_pinned(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
        hints: &AttachHints,
    ) -> Result<Attachment, DataplaneError> {
        let dir = self
            .pin_dir
            .clone()
            .expect("attach_pinned after load_pinned");
        let link_path = dir.join(LINK_PIN);
        // Take over a pinned link of a mode the configuration accepts; otherwise (a
        // changed xdp_mode) attach afresh.
        let wanted = |m: AttachedMode| accepts(mode, m);
        // Generic because native could not serve when it was attached (a veth's peer
        // without a program): once native is known to serve, move to it. The kernel
        // holds one mode at a time, so the interface is without a program for the
        // moment between the two.
        let to_native = |m: AttachedMode| {
            mode == XdpModeSetting::Auto && m == AttachedMode::Generic && hints.native_known
        };
        if self.link_mode.is_some_and(to_native) && link_path.exists() {
            tracing::warn!(
                "the pinned program runs in generic mode and native mode can serve {interface} \
                 now: moving it to native (a moment without a program on the interface)"
            );
            return self.move_to_native(interface, &link_path, hints);
        }
        if let Some(mode) = self.link_mode.filter(|m| wanted(*m) && !to_native(*m))
            && link_path.exists()
        {
            self.take_over(&link_path)?;
            pins::write_meta(&mut self.meta, &self.options, Some(mode))?;
            return Ok(Attachment {
                mode,
                native_refused: None,
            });
        }
        self.attach_afresh(interface, mode, &link_path, hints)
    }

    /// Puts this program on the link pinned at `link_path`, in one step: no frame sees no
    /// program. The link stays pinned.
    fn take_over(&mut self, link_path: &Path) -> Result<(), DataplaneError> {
        let link = pins::open_pinned_link(link_path)?;
        let program = program(&mut self.ebpf)?;
        let id = program.attach_to_link(link).map_err(lb_xdp_error)?;
        // The link stays pinned; our handle to it must not detach it on exit.
        let link = program.take_link(id).map_err(lb_xdp_error)?;
        std::mem::forget(link);
        Ok(())
    }

    /// Replaces the link pinned at `link_path` (if any) with a new one of this program on
    /// `interface`, and records the mode attached.
    fn attach_afresh(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
        link_path: &Path,
        hints: &AttachHints,
    ) -> Result<Attachment, DataplaneError> {
        let (attachment, id) = if pins::remove_link_pin(link_path)? {
            self.attach_link_when_free(interface, mode, hints)?
        } else {
            self.attach_link(interface, mode, hints)?
        };
        self.pin_attached(id, link_path, attachment)
    }

    /// Replaces the generic link pinned at `link_path` with a native one; should native
    /// be refused after all, attaches generic again and says why.
    fn move_to_native(
        &mut self,
        interface: &str,
        link_path: &Path,
        hints: &AttachHints,
    ) -> Result<Attachment, DataplaneError> {
        pins::remove_link_pin(link_path)?;
        let removed = std::time::Instant::now();
        let native = self.attach_link_when_free(interface, XdpModeSetting::Native, hints);
        let (attachment, id) = match native {
            Ok(attached) => {
                tracing::info!(
                    "{interface}: native mode attached {:.1?} after the generic link was removed",
                    removed.elapsed()
                );
                attached
            }
            Err(refused) => {
                tracing::warn!("native mode refused after all ({refused}): generic again");
                let (mut attachment, id) =
                    self.attach_link_when_free(interface, XdpModeSetting::Generic, hints)?;
                attachment.native_refused = Some(refused.to_string());
                (attachment, id)
            }
        };
        self.pin_attached(id, link_path, attachment)
    }

    /// `attach_link`, retried while the interface still holds a program (EBUSY, EEXIST)
    /// for up to [`LINK_RELEASE_WAIT`]: a link whose last pin was just removed leaves the
    /// interface when the kernel frees it, a moment later (deferred), not at once.
    fn attach_link_when_free(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
        hints: &AttachHints,
    ) -> Result<(Attachment, XdpLinkId), DataplaneError> {
        let deadline = std::time::Instant::now() + LINK_RELEASE_WAIT;
        loop {
            match self.attach_link(interface, mode, hints) {
                Err(DataplaneError::Attach { source, .. })
                    if matches!(attach::errno(&source), Some(libc::EBUSY | libc::EEXIST))
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                attached => return attached,
            }
        }
    }

    /// Pins the new link `id` at `link_path` and records the mode attached.
    fn pin_attached(
        &mut self,
        id: XdpLinkId,
        link_path: &Path,
        attachment: Attachment,
    ) -> Result<Attachment, DataplaneError> {
        let link = program(&mut self.ebpf)?
            .take_link(id)
            .map_err(lb_xdp_error)?;
        pins::pin_link(link, link_path)?;
        // `LB_META` records the first interface's link; the others' modes are in
        // `LB_EGRESS` (`set_egress`).
        if link_path.file_name() == Some(std::ffi::OsStr::new(LINK_PIN)) {
            pins::write_meta(&mut self.meta, &self.options, Some(attachment.mode))?;
        }
        Ok(attachment)
    }

    /// Attaches to `interface` (`attach_xdp`).
    fn attach_link(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
        hints: &AttachHints,
    ) -> Result<(Attachment, XdpLinkId), DataplaneError> {
        attach_xdp(program(&mut self.ebpf)?, interface, mode, hints)
    }

    /// The loaded program, for BPF_PROG_TEST_RUN in tests and benchmarks.
    pub fn program_mut(&mut self) -> Result<&mut Xdp, DataplaneError> {
        program(&mut self.ebpf)
    }

    /// The debug capture's ring buffer, for `capture::write_pcap` (once).
    pub fn take_capture(&mut self) -> Result<aya::maps::RingBuf<MapData>, DataplaneError> {
        let (kept, ring) = take_ring(&mut self.ebpf, MAP_CAPTURE)?;
        self.capture = kept;
        Ok(ring)
    }

    /// The cluster's export ring buffer and a handle that writes learned entries into the
    /// connection table, for `cluster` (once).
    pub fn take_export(
        &mut self,
    ) -> Result<(aya::maps::RingBuf<MapData>, FlowWriter), DataplaneError> {
        let (kept, ring) = take_ring(&mut self.ebpf, MAP_EXPORT)?;
        self.export = kept;
        Ok((ring, FlowWriter::of(&self.conntrack)?))
    }

    /// See `Dataplane::follow_interface`. The new program shares every map with the
    /// running one: the pinned maps by their pins, this instance's own (heavy hitters,
    /// the capture ring, per-CPU state) through pins made for the load and removed after.
    /// Only its read-only data differs: the interface's MAC.
    pub fn follow(&mut self, target: &AttachTarget) -> Result<AttachedMode, DataplaneError> {
        let dir = self
            .pin_dir
            .clone()
            .expect("follow_interface after load_pinned");
        let mut options = self.options;
        options.iface_mac = target.mac;
        options.ifindex = target.ifindex;
        let ebpf = self.load_sharing_maps(target.object, &options, &dir)?;
        // The old program goes once the new one is attached (dropping it detaches
        // nothing: its link is pinned).
        let _old = std::mem::replace(&mut self.ebpf, ebpf);
        self.options = options;
        let link_path = dir.join(LINK_PIN);
        if let Some(mode) = target.attached
            && link_path.exists()
        {
            // The interface is the one the link is on: swap the program in one step.
            let link = pins::open_pinned_link(&link_path)?;
            let program = program(&mut self.ebpf)?;
            match program.attach_to_link(link) {
                Ok(id) => {
                    std::mem::forget(program.take_link(id).map_err(lb_xdp_error)?);
                    pins::write_meta(&mut self.meta, &self.options, Some(mode))?;
                    return Ok(mode);
                }
                Err(error) => tracing::warn!(
                    "replacing the program on its link failed ({error}); attaching afresh"
                ),
            }
        }
        // A new interface of that name: the old link went with the old interface.
        let attachment = self.attach_afresh(
            &target.interface,
            target.mode,
            &link_path,
            &AttachHints::default(),
        )?;
        if let Some(why) = &attachment.native_refused {
            tracing::warn!("xdp_mode = \"auto\": attached in generic mode; native refused: {why}");
        }
        Ok(attachment.mode)
    }

    /// Loads the program again with `options`, on this instance's maps.
    fn load_sharing_maps(
        &self,
        object: &[u8],
        options: &LoadOptions,
        dir: &Path,
    ) -> Result<Ebpf, DataplaneError> {
        // bpffs refuses names with a dot.
        let instance = dir.join(format!("follow-{}", std::process::id()));
        let pin_error = |source| DataplaneError::Pin {
            path: instance.clone(),
            source,
        };
        std::fs::create_dir_all(&instance).map_err(pin_error)?;
        let pinned = self.pin_instance_maps(&instance);
        let loaded = pinned.and_then(|names| {
            Self::load_program(object, options, Some(dir), Some((&instance, &names)))
        });
        // The maps live on in both programs' descriptors; the pins were for the load.
        let removed = std::fs::remove_dir_all(&instance).map_err(pin_error);
        let ebpf = loaded?;
        removed?;
        Ok(ebpf)
    }

    /// Pins the maps of this program instance (neither pinned for restarts nor the
    /// object's read-only data) in `dir`; returns their names.
    fn pin_instance_maps(&self, dir: &Path) -> Result<Vec<String>, DataplaneError> {
        let pin = |name: &str, pinned: Result<(), aya::pin::PinError>| {
            pinned.map_err(|source| DataplaneError::PinMap {
                path: dir.join(name),
                source,
            })
        };
        let mut names = Vec::new();
        for (name, map) in self.ebpf.maps() {
            if name.starts_with('.') || PINNED_MAPS.contains(&name) {
                continue;
            }
            pin(name, map.pin(dir.join(name)))?;
            names.push(name.to_string());
        }
        // Taken out of `ebpf` at load (and by `take_capture`).
        let taken = [
            (MAP_SOURCES, Some(IterableMap::map(&self.sources))),
            (MAP_HOT_SOURCES, Some(IterableMap::map(&self.hot_sources))),
            (MAP_QUIC_IDS, Some(IterableMap::map(&self.quic_ids))),
            (MAP_QUIC_STATS, Some(IterableMap::map(&self.quic_stats))),
            (MAP_CAPTURE, self.capture.as_ref()),
            (MAP_EXPORT, self.export.as_ref()),
        ];
        for (name, map) in taken {
            if let Some(map) = map
                && !names.iter().any(|n| n == name)
            {
                pin(name, map.pin(dir.join(name)))?;
                names.push(name.to_string());
            }
        }
        Ok(names)
    }

    /// Puts `next` in the slot the program tail-calls with the frames it passes, or
    /// empties it (None). Refused when the loaded build cannot call `next` (the kernel
    /// admits only a program of the same multi-buffer kind): a restart loads the other.
    pub fn chain(&mut self, next: Option<&NextProgram>) -> Result<Option<u32>, DataplaneError> {
        if let Some(next) = next
            && next.caller() != self.options.program
        {
            return Err(DataplaneError::NextProgramKind {
                path: next.path.clone(),
                label: next.label(),
                caller: next.caller(),
                loaded: self.options.program,
            });
        }
        let fd = self.next_map()?;
        let before =
            next::slot_program(fd.as_fd()).map_err(|e| syscall_error(MAP_NEXT, "lookup", e))?;
        let written = match next {
            Some(next) => next.put_in(fd.as_fd()),
            None => next::clear_slot(fd.as_fd()),
        };
        written.map_err(|e| syscall_error(MAP_NEXT, "bpf_map_update_elem", e))?;
        Ok(before)
    }

    /// Pins `LB_NEXT` in the pin directory in place of a previous program's, so the slot
    /// outlives the agent (the kernel empties a program array no user-space handle holds).
    /// Called once the program is attached: until then the previous program runs, and
    /// its array must keep its pin.
    pub fn pin_next_program_map(&mut self) -> Result<(), DataplaneError> {
        let Some(dir) = self.pin_dir.clone() else {
            return Ok(());
        };
        let path = dir.join(MAP_NEXT);
        pins::remove_pin(&path)?;
        let map = self
            .ebpf
            .map(MAP_NEXT)
            .ok_or(DataplaneError::MissingMap { map: MAP_NEXT })?;
        map.pin(&path)
            .map_err(|source| DataplaneError::PinMap { path, source })
    }

    /// A descriptor of `LB_NEXT`, which stays in `ebpf` (`follow` shares it with the
    /// program it loads, as every map of this instance).
    fn next_map(&self) -> Result<std::os::fd::OwnedFd, DataplaneError> {
        let Some(aya::maps::Map::ProgramArray(map)) = self.ebpf.map(MAP_NEXT) else {
            return Err(DataplaneError::MissingMap { map: MAP_NEXT });
        };
        map.fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| syscall_error(MAP_NEXT, "dup", e))
    }

    /// Writes a connection-table entry (tests: to age or plant an entry).
    pub fn insert_flow(&mut self, key: &FlowKey, entry: &FlowEntry) -> Result<(), DataplaneError> {
        self.conntrack
            .insert(key, entry, 0)
            .map_err(in_map(MAP_CONNTRACK))
    }

    /// The XDP_TX counter: how many packets were forwarded so far.
    pub fn forwarded(&self) -> Result<u64, DataplaneError> {
        Ok(self.outcomes()?[stat::XDP_TX as usize])
    }

    /// Every outcome counter, summed over CPUs.
    fn outcomes(&self) -> Result<Vec<u64>, DataplaneError> {
        self.counter_maps().outcomes()
    }

    /// The counter maps, for `counters` and their own-handle reader.
    fn counter_maps(&self) -> CounterMaps<'_> {
        CounterMaps {
            stats: &self.stats,
            vip_stats: &self.vip_stats,
            backend_stats: &self.backend_stats,
            sources: &self.sources,
            quic_stats: &self.quic_stats,
            egress_stats: &self.egress_stats,
            egress_count: self.options.egress_count,
        }
    }
}

/// Whether a link attached in mode `attached` serves `xdp_mode = setting`.
fn accepts(setting: XdpModeSetting, attached: AttachedMode) -> bool {
    match setting {
        XdpModeSetting::Auto => true,
        XdpModeSetting::Native => attached == AttachedMode::Native,
        XdpModeSetting::Generic => attached == AttachedMode::Generic,
    }
}

/// The build of the balancer that was loaded (`LoadOptions::program`).
fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, DataplaneError> {
    let loaded = [next::LB_XDP, next::LB_XDP_1BUF].into_iter().find(|name| {
        ebpf.program(name)
            .and_then(|p| <&Xdp>::try_from(p).ok())
            .is_some_and(|p| p.fd().is_ok())
    });
    let program = ebpf
        .program_mut(loaded.unwrap_or(next::LB_XDP))
        .ok_or_else(|| lb_xdp_error(aya::programs::ProgramError::NotLoaded))?;
    program.try_into().map_err(lb_xdp_error)
}

/// Takes ring buffer `name` out of `ebpf`, keeping a second handle on its map: a program
/// loaded by `follow_interface` must write into the same ring.
fn take_ring(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<(Option<MapData>, aya::maps::RingBuf<MapData>), DataplaneError> {
    let mut kept = None;
    if let Some(aya::maps::Map::RingBuf(ring)) = ebpf.map(name) {
        kept = Some(dup_map(ring, name)?);
    }
    Ok((kept, take_map(ebpf, name)?))
}

/// Attaches `program` to `interface`. `Auto` tries native (driver) mode, then generic,
/// and keeps why native was refused; it goes to generic at once when `hints` know native
/// cannot serve.
pub(super) fn attach_xdp(
    program: &mut Xdp,
    interface: &str,
    mode: XdpModeSetting,
    hints: &AttachHints,
) -> Result<(Attachment, XdpLinkId), DataplaneError> {
    let mut try_attach = |attached: AttachedMode| {
        let (xdp_mode, name) = match attached {
            AttachedMode::Native => (XdpMode::Driver, "native"),
            AttachedMode::Generic => (XdpMode::Skb, "generic"),
        };
        program
            .attach(interface, xdp_mode)
            .map(|id| (attached, id))
            .map_err(|source| DataplaneError::Attach {
                interface: interface.to_string(),
                mode: name,
                meaning: attach::meaning(attach::errno(&source), name, interface, hints),
                source: Box::new(source),
            })
    };
    let (mode, native_refused, id) = match mode {
        XdpModeSetting::Native => {
            let (mode, id) = try_attach(AttachedMode::Native)?;
            (mode, None, id)
        }
        XdpModeSetting::Generic => {
            let (mode, id) = try_attach(AttachedMode::Generic)?;
            (mode, None, id)
        }
        XdpModeSetting::Auto => match &hints.native_refused {
            Some(why) => {
                let (mode, id) = try_attach(AttachedMode::Generic)?;
                (mode, Some(why.clone()), id)
            }
            None => match try_attach(AttachedMode::Native) {
                Ok((mode, id)) => (mode, None, id),
                Err(native) => {
                    let why = match &native {
                        DataplaneError::Attach { meaning, .. } => meaning.clone(),
                        other => other.to_string(),
                    };
                    let (mode, id) = try_attach(AttachedMode::Generic)?;
                    (mode, Some(why), id)
                }
            },
        },
    };
    Ok((
        Attachment {
            mode,
            native_refused,
        },
        id,
    ))
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(DataplaneError::MissingMap { map: name })?;
    T::try_from(map).map_err(in_map(name))
}

/// Zeroes entry `index` of a per-CPU counter map on every CPU.
fn zero<T: aya::Pod + Default>(
    map: &mut PerCpuArray<MapData, T>,
    name: &'static str,
    index: u32,
) -> Result<(), DataplaneError> {
    let cpus = aya::util::nr_cpus().map_err(|(_, source)| DataplaneError::Cpus(source))?;
    let zeros = aya::maps::PerCpuValues::try_from(vec![T::default(); cpus])
        .map_err(DataplaneError::Cpus)?;
    map.set(index, zeros, 0).map_err(in_map(name))
}

/// An error of the `lb_xdp` program (loading, attaching, links).
fn lb_xdp_error(source: aya::programs::ProgramError) -> DataplaneError {
    DataplaneError::Program {
        program: "lb_xdp",
        source,
    }
}

impl Dataplane for AyaDataplane {
    fn write_slots(&mut self, slots: &[(u32, u32)]) -> Result<(), DataplaneError> {
        // One bpf() call per chunk instead of one per slot (a full table is 65537).
        if slots.len() > 1 && self.batch_writes {
            let fd = IterableMap::map(&self.maglev).fd().as_fd().as_raw_fd();
            match update_batch(fd, slots) {
                Ok(()) => return Ok(()),
                // An old kernel: each slot on its own from now on.
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    self.batch_writes = false;
                }
                Err(source) => {
                    return Err(syscall_error(MAP_MAGLEV, "bpf_map_update_batch", source));
                }
            }
        }
        for &(slot, id) in slots {
            self.maglev.set(slot, id, 0).map_err(in_map(MAP_MAGLEV))?;
        }
        Ok(())
    }

    fn set_vip(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError> {
        self.vips.set(key, info)
    }

    fn remove_vip(&mut self, key: &VipKey) -> Result<(), DataplaneError> {
        self.vips.remove(key)
    }

    fn set_backend(
        &mut self,
        id: u32,
        info: &BackendInfo,
        identity: &BackendIdentity,
    ) -> Result<(), DataplaneError> {
        debug_assert!(id < self.options.max_backends);
        self.identities
            .set(id, identity, 0)
            .map_err(in_map(MAP_BACKEND_IDS))?;
        self.backends.set(id, info, 0).map_err(in_map(MAP_BACKENDS))
    }

    fn set_backend_egress(&mut self, id: u32, egress: u32) -> Result<(), DataplaneError> {
        self.write_backend_egress(id, egress)
    }

    fn set_egress(&mut self, index: u32, port: &EgressPort) -> Result<(), DataplaneError> {
        self.record_egress(index, port)
    }

    fn attach_port(
        &mut self,
        index: usize,
        port: &EgressPort,
        mode: XdpModeSetting,
    ) -> Result<Attachment, DataplaneError> {
        self.attach_more(
            index,
            &port.name,
            port.ifindex,
            mode,
            &AttachHints::default(),
        )
    }

    fn set_tunnel(&mut self, tunnel: &TunnelConfig) -> Result<(), DataplaneError> {
        self.tunnel.set(0, tunnel, 0).map_err(in_map(MAP_TUNNEL))
    }

    fn counters(&self, vip_ids: &[u32], backend_ids: &[u32]) -> Result<Counters, DataplaneError> {
        self.counter_maps().counters(vip_ids, backend_ids)
    }

    fn counter_reader(&self) -> Result<Option<CounterReader>, DataplaneError> {
        CounterReader::of(&self.counter_maps()).map(Some)
    }

    fn flow_lookups(&self) -> Result<Option<FlowLookups>, DataplaneError> {
        FlowLookups::of(&self.conntrack, &self.embryonic, &self.hot_sources).map(Some)
    }

    fn reset_vip_counters(&mut self, vip_id: u32) -> Result<(), DataplaneError> {
        zero(&mut self.quic_stats, MAP_QUIC_STATS, vip_id)?;
        zero(&mut self.vip_stats, MAP_VIP_STATS, vip_id)
    }

    fn reset_backend_counters(&mut self, backend_id: u32) -> Result<(), DataplaneError> {
        zero(&mut self.backend_stats, MAP_BACKEND_STATS, backend_id)
    }

    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        match self.conntrack.get(key, 0) {
            Ok(entry) => Ok(Some(entry)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(in_map(MAP_CONNTRACK)(source)),
        }
    }

    fn embryo(&self, index: u32) -> Result<Embryo, DataplaneError> {
        self.embryonic.get(&index, 0).map_err(in_map(MAP_EMBRYONIC))
    }

    fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError> {
        self.counter_maps().sources()
    }

    fn hot_sources(&self) -> Result<Vec<SourceKey>, DataplaneError> {
        self.hot_sources
            .keys()
            .filter(|key| !matches!(key, Err(aya::maps::MapError::KeyNotFound)))
            .collect::<Result<_, _>>()
            .map_err(in_map(MAP_HOT_SOURCES))
    }

    fn is_hot_source(&self, key: &SourceKey) -> Result<bool, DataplaneError> {
        match self.hot_sources.get(key, 0) {
            Ok(_) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(source) => Err(in_map(MAP_HOT_SOURCES)(source)),
        }
    }

    fn set_hot_source(&mut self, key: &SourceKey, hot: bool) -> Result<(), DataplaneError> {
        let written = if hot {
            self.hot_sources.insert(key, 1, 0)
        } else {
            match self.hot_sources.remove(key) {
                Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                other => other,
            }
        };
        written.map_err(in_map(MAP_HOT_SOURCES))
    }

    fn flow_reader(&self) -> Result<FlowReader, DataplaneError> {
        FlowReader::of(&self.conntrack)
    }

    fn quic_ids(&self) -> Result<Vec<(ServerKey, u32)>, DataplaneError> {
        self.quic_ids
            .iter()
            .filter(|item| !matches!(item, Err(aya::maps::MapError::KeyNotFound)))
            .collect::<Result<_, _>>()
            .map_err(in_map(MAP_QUIC_IDS))
    }

    fn set_quic_id(&mut self, key: &ServerKey, backend: Option<u32>) -> Result<(), DataplaneError> {
        let written = match backend {
            Some(id) => self.quic_ids.insert(key, id, 0),
            None => match self.quic_ids.remove(key) {
                Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                other => other,
            },
        };
        written.map_err(in_map(MAP_QUIC_IDS))
    }

    fn follow_interface(&mut self, target: &AttachTarget) -> Result<AttachedMode, DataplaneError> {
        self.follow(target)
    }

    fn set_next_program(
        &mut self,
        next: Option<&NextProgram>,
    ) -> Result<Option<u32>, DataplaneError> {
        self.chain(next)
    }
}
