//! An in-memory data path for unit tests of what is written and in which order.

use std::collections::{HashMap, HashSet};

use lb_common::{
    BackendIdentity, BackendInfo, Embryo, FlowEntry, FlowKey, SourceKey, TunnelConfig, VipInfo,
    VipKey, quic::ServerKey, stat,
};

use super::{Counters, Dataplane, DataplaneError, FlowReader};

/// One write to the data path, as recorded by `MemoryDataplane`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Slots(Vec<(u32, u32)>),
    Vip(VipKey, VipInfo),
    RemoveVip(VipKey),
    Backend(u32, BackendInfo, BackendIdentity),
    Tunnel(TunnelConfig),
    ResetVip(u32),
    ResetBackend(u32),
}

/// An in-memory data path that does what the kernel's maps do and records every write.
#[derive(Debug, Default)]
pub struct MemoryDataplane {
    pub vips: HashMap<VipKey, VipInfo>,
    pub maglev: HashMap<u32, u32>,
    pub backends: HashMap<u32, BackendInfo>,
    pub flows: HashMap<FlowKey, FlowEntry>,
    pub embryos: HashMap<u32, Embryo>,
    pub sources: HashMap<SourceKey, u64>,
    pub hot_sources: HashSet<SourceKey>,
    pub quic_ids: HashMap<ServerKey, u32>,
    pub tunnel: TunnelConfig,
    pub log: Vec<Write>,
}

impl Dataplane for MemoryDataplane {
    fn write_slots(&mut self, slots: &[(u32, u32)]) -> Result<(), DataplaneError> {
        self.maglev.extend(slots.iter().copied());
        self.log.push(Write::Slots(slots.to_vec()));
        Ok(())
    }

    fn set_vip(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError> {
        self.vips.insert(*key, *info);
        self.log.push(Write::Vip(*key, *info));
        Ok(())
    }

    fn remove_vip(&mut self, key: &VipKey) -> Result<(), DataplaneError> {
        self.vips.remove(key);
        self.log.push(Write::RemoveVip(*key));
        Ok(())
    }

    fn set_backend(
        &mut self,
        id: u32,
        info: &BackendInfo,
        identity: &BackendIdentity,
    ) -> Result<(), DataplaneError> {
        self.backends.insert(id, *info);
        self.log.push(Write::Backend(id, *info, *identity));
        Ok(())
    }

    fn set_tunnel(&mut self, tunnel: &TunnelConfig) -> Result<(), DataplaneError> {
        self.tunnel = *tunnel;
        self.log.push(Write::Tunnel(*tunnel));
        Ok(())
    }

    fn counters(&self, _: &[u32], _: &[u32]) -> Result<Counters, DataplaneError> {
        Ok(Counters {
            outcomes: vec![0; stat::COUNT as usize],
            ..Counters::default()
        })
    }

    fn reset_vip_counters(&mut self, vip_id: u32) -> Result<(), DataplaneError> {
        self.log.push(Write::ResetVip(vip_id));
        Ok(())
    }

    fn reset_backend_counters(&mut self, backend_id: u32) -> Result<(), DataplaneError> {
        self.log.push(Write::ResetBackend(backend_id));
        Ok(())
    }

    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        Ok(self.flows.get(key).copied())
    }

    fn embryo(&self, index: u32) -> Result<Embryo, DataplaneError> {
        Ok(self.embryos.get(&index).copied().unwrap_or_default())
    }

    fn flow_reader(&self) -> Result<FlowReader, DataplaneError> {
        Ok(FlowReader::snapshot(
            self.flows.iter().map(|(k, v)| (*k, *v)).collect(),
        ))
    }

    fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError> {
        Ok(self.sources.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn hot_sources(&self) -> Result<Vec<SourceKey>, DataplaneError> {
        Ok(self.hot_sources.iter().copied().collect())
    }

    fn is_hot_source(&self, key: &SourceKey) -> Result<bool, DataplaneError> {
        Ok(self.hot_sources.contains(key))
    }

    fn quic_ids(&self) -> Result<Vec<(ServerKey, u32)>, DataplaneError> {
        Ok(self.quic_ids.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn set_quic_id(&mut self, key: &ServerKey, backend: Option<u32>) -> Result<(), DataplaneError> {
        match backend {
            Some(id) => self.quic_ids.insert(*key, id),
            None => self.quic_ids.remove(key),
        };
        Ok(())
    }

    fn set_hot_source(&mut self, key: &SourceKey, hot: bool) -> Result<(), DataplaneError> {
        if hot {
            self.hot_sources.insert(*key);
        } else {
            self.hot_sources.remove(key);
        }
        Ok(())
    }
}
