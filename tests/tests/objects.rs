//! Tier 1 (no root): what each eBPF object holds. The `lb` binary embeds the production
//! object, which must carry the balancer and its maps only, and the backends' decap
//! object; the programs that tests and benchmarks load live in the test object.

use std::collections::BTreeSet;

use lb_tests::program::TEST_OBJECT;
use lb_userspace::EBPF_OBJECT;

/// The programs and maps (by name; the globals' sections `.rodata`, `.data`, `.bss`
/// left out) of an object, as aya parses it; `None` after a loud skip when it is empty.
fn contents(test: &str, object: &[u8]) -> Option<(BTreeSet<String>, BTreeSet<String>)> {
    if object.is_empty() {
        lb_tests::skip(
            test,
            "the eBPF objects are empty (built with AYA_BUILD_SKIP=1)",
        );
        return None;
    }
    let parsed = aya_obj::Object::parse(object).expect("parse the object");
    assert_eq!(parsed.license.to_str(), Ok("GPL"), "{test}: the licence");
    let programs = parsed.programs.keys().cloned().collect();
    let maps = parsed
        .maps
        .keys()
        .filter(|name| !name.starts_with('.'))
        .cloned()
        .collect();
    Some((programs, maps))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn the_production_object_holds_the_balancer_only() {
    let Some((programs, maps)) =
        contents("the_production_object_holds_the_balancer_only", EBPF_OBJECT)
    else {
        return;
    };
    // The balancer in its two builds: multi-buffer aware, and not (for a next_program
    // that is not).
    assert_eq!(
        programs,
        BTreeSet::from(["lb_xdp".to_string(), "lb_xdp_1buf".to_string()])
    );
    for map in &maps {
        assert!(map.starts_with("LB_"), "map {map} in the production object");
    }
    assert!(maps.contains(lb_common::MAP_CONNTRACK), "{maps:?}");
    // Neither the benchmark map nor the generator's global, under any name.
    assert!(
        !contains(EBPF_OBJECT, b"BENCH_"),
        "a BENCH_ name in the production object"
    );
}

#[test]
fn the_test_object_holds_the_test_programs_and_no_balancer_map() {
    let Some((programs, maps)) = contents(
        "the_test_object_holds_the_test_programs_and_no_balancer_map",
        TEST_OBJECT,
    ) else {
        return;
    };
    let expected = ["xdp_bench_sink", "xdp_bench_tx", "xdp_mac_swap", "xdp_pass"];
    assert_eq!(programs, expected.map(String::from).into());
    assert_eq!(
        maps,
        BTreeSet::from([lb_common::MAP_BENCH_SINK.to_string()])
    );
    assert!(contains(
        TEST_OBJECT,
        lb_common::GLOBAL_BENCH_FLOWS.as_bytes()
    ));
}

#[test]
fn the_decap_object_holds_the_decap_program_and_its_maps() {
    use lb_common::decap;
    let Some((programs, maps)) = contents(
        "the_decap_object_holds_the_decap_program_and_its_maps",
        lb_userspace::DECAP_OBJECT,
    ) else {
        return;
    };
    assert_eq!(programs, BTreeSet::from([decap::PROGRAM.to_string()]));
    let expected = [decap::MAP_STATS, decap::MAP_ADDRS, decap::MAP_CONFIG];
    assert_eq!(maps, expected.map(String::from).into());
}
