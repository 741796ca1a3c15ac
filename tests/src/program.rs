//! A program instance of its own (attached to nothing), its maps written by the agent's
//! own code from a configuration: what the packet fixtures and the benchmarks run
//! BPF_PROG_TEST_RUN against. And the test object's programs (`xdp_pass`, the benchmark
//! generator, sink and baseline), which the production object does not carry.

use anyhow::{Context, Result, anyhow, ensure};
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
        let variant = variant_object()?;
        Self::load_object(text, variant.as_deref().unwrap_or(EBPF_OBJECT), adjust)
    }

    /// `load_with` from the `lb_xdp` object `object` (a variant of the program built
    /// from another tree with this one's map layout, which a benchmark runs beside the
    /// built-in one).
    pub fn load_object(
        text: &str,
        object: &[u8],
        adjust: impl FnOnce(&mut LoadOptions),
    ) -> Result<Instance> {
        let config = Config::from_toml(text).context("the instance's config")?;
        let mut options = LoadOptions::from_config(&config, IFACE_MAC);
        adjust(&mut options);
        let dataplane = AyaDataplane::load(object, options).context("load lb_xdp")?;
        let model = Model::new(
            config.dataplane.maglev_table_size,
            vip_capacity(config.vips.len()),
            config.dataplane.flow_idle_timeout,
        )
        .with_backend_capacity(dataplane.options().max_backends);
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

/// The `lb_xdp` object named by `LB_XDP_OBJECT`, when set: a variant of the program
/// built from another tree with this one's map layout, so that the benchmarks can
/// compare the two with the same userspace, alternating in the same run. None: the
/// built-in object.
fn variant_object() -> Result<Option<Vec<u8>>> {
    let Some(path) = std::env::var_os("LB_XDP_OBJECT") else {
        return Ok(None);
    };
    let bytes = std::fs::read(&path)
        .with_context(|| format!("LB_XDP_OBJECT: cannot read {}", path.to_string_lossy()))?;
    Ok(Some(bytes))
}

/// The test object `lb-test-xdp` (`xdp_pass`, `xdp_mac_swap`, `xdp_bench_tx`,
/// `xdp_bench_sink` and `BENCH_SINK`), built beside the balancer by lb-userspace's build
/// script (see `build.rs`). Empty when built with `AYA_BUILD_SKIP=1`.
pub static TEST_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("LB_TEST_OBJECT"));

/// A new instance of the test object with its program `name` loaded (not attached), the
/// benchmark generator set to cycle through `bench_flows` flows
/// (`lb_common::GLOBAL_BENCH_FLOWS`).
pub fn load_test_program(name: &str, bench_flows: u64) -> Result<aya::Ebpf> {
    load_test_program_with_eth(name, bench_flows, [0; 14])
}

/// `load_test_program`, with the generator writing `bench_eth` as every frame's
/// Ethernet header (`lb_common::GLOBAL_BENCH_ETH`): for frames the receiver rewrites
/// beyond the MACs (a tunnel's outer headers), which live frames would otherwise carry
/// into the next batch.
pub fn load_test_program_with_eth(
    name: &str,
    bench_flows: u64,
    bench_eth: [u8; 14],
) -> Result<aya::Ebpf> {
    ensure!(
        !TEST_OBJECT.is_empty(),
        "the test eBPF object is empty (built with AYA_BUILD_SKIP=1?)"
    );
    let mut ebpf = aya::EbpfLoader::new()
        .override_global(lb_common::GLOBAL_BENCH_FLOWS, &bench_flows, true)
        .override_global(lb_common::GLOBAL_BENCH_ETH, &bench_eth, true)
        .load(TEST_OBJECT)
        .context("load the test eBPF object")?;
    let program: &mut aya::programs::Xdp = ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("no program {name} in the test eBPF object"))?
        .try_into()
        .with_context(|| format!("{name} is not an XDP program"))?;
    program.load().with_context(|| format!("load {name}"))?;
    Ok(ebpf)
}
