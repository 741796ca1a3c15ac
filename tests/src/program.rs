//! A program instance of its own (attached to nothing), its maps written by the agent's
//! own code from a configuration: what the packet fixtures and the benchmarks run
//! BPF_PROG_TEST_RUN against.

use anyhow::{Context, Result};
use lb_userspace::{
    EBPF_OBJECT,
    config::Config,
    dataplane::{AyaDataplane, LoadOptions, vip_capacity},
    model::Model,
    tables::TableWriter,
};

/// The MAC the instance takes as its interface's: the source of forwarded frames.
pub const IFACE_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x02];

pub struct Instance {
    pub dataplane: AyaDataplane,
    pub model: Model,
    pub writer: TableWriter,
    pub config: Config,
}

impl Instance {
    pub fn load(text: &str) -> Result<Instance> {
        Self::load_with(text, |_| {})
    }

    /// `load`, with load-time options changed by `adjust`.
    pub fn load_with(text: &str, adjust: impl FnOnce(&mut LoadOptions)) -> Result<Instance> {
        let config = Config::from_toml(text).context("the instance's config")?;
        let mut options = LoadOptions::from_config(&config, IFACE_MAC);
        adjust(&mut options);
        let dataplane = AyaDataplane::load(EBPF_OBJECT, options).context("load lb_xdp")?;
        let model = Model::new(
            config.dataplane.maglev_table_size,
            vip_capacity(config.vips.len()),
            config.dataplane.flow_idle_timeout,
        );
        let writer = TableWriter::new(config.dataplane.maglev_table_size);
        let mut instance = Instance {
            dataplane,
            model,
            writer,
            config,
        };
        instance.reconfigure(text)?;
        Ok(instance)
    }

    /// Follows a new configuration, as a reload does.
    pub fn reconfigure(&mut self, text: &str) -> Result<()> {
        self.config = Config::from_toml(text).context("the instance's config")?;
        self.model.update(&self.config)?;
        self.sync()
    }

    /// Writes the model's tables.
    pub fn sync(&mut self) -> Result<()> {
        self.writer
            .apply(&mut self.dataplane, &self.model.desired())
            .context("write the tables")?;
        Ok(())
    }
}
