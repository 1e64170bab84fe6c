//! The ABI between lb's kernel programs and its userspace: map names, key and value layouts,
//! flag bits and counter indices.
//!
//! Every type is `#[repr(C)]` with explicit padding fields, so the layout is the same on both
//! sides and `bpftool map dump` prints every byte under a field name. Addresses are stored as
//! byte arrays in network order (bpftool prints them as `[198,18,0,10]`); ports and ids are
//! stored in host order so dumps read naturally.
//!
//! Layout follows Cilium's: a service frontend `(vip, port, proto, scope)` has a master entry
//! at slot 0 (backend count, flags, rev-NAT id) and one entry per backend at slots `1..=count`,
//! each naming a backend id; backends live in their own map keyed by id, and the rev-NAT map
//! turns a rev-NAT id back into the frontend address for replies.
#![no_std]

mod entries;
mod flags;
mod hash;
pub mod metrics;
mod names;
mod trace;

pub use entries::*;
pub use flags::*;
pub use hash::*;
pub use names::*;
pub use trace::*;

#[cfg(feature = "user")]
mod user {
    // SAFETY: each type is repr(C), Copy, has no padding (bytemuck's derive checks that) and is
    // valid for any bit pattern.
    unsafe impl aya::Pod for super::Svc4Key {}
    unsafe impl aya::Pod for super::Svc6Key {}
    unsafe impl aya::Pod for super::SvcValue {}
    unsafe impl aya::Pod for super::EchoKey4 {}
    unsafe impl aya::Pod for super::EchoKey6 {}
    unsafe impl aya::Pod for super::EchoValue {}
    unsafe impl aya::Pod for super::Backend4 {}
    unsafe impl aya::Pod for super::Backend6 {}
    unsafe impl aya::Pod for super::RevNat4 {}
    unsafe impl aya::Pod for super::RevNat6 {}
    unsafe impl aya::Pod for super::Ct4Key {}
    unsafe impl aya::Pod for super::Ct6Key {}
    unsafe impl aya::Pod for super::Ct4Value {}
    unsafe impl aya::Pod for super::Ct6Value {}
    unsafe impl aya::Pod for super::LbConfig {}
    unsafe impl aya::Pod for super::SkRevNat4Key {}
    unsafe impl aya::Pod for super::SkRevNat4Value {}
    unsafe impl aya::Pod for super::SkRevNat6Key {}
    unsafe impl aya::Pod for super::SkRevNat6Value {}
    unsafe impl aya::Pod for super::SkStore4 {}
    unsafe impl aya::Pod for super::SkStore6 {}
    unsafe impl aya::Pod for super::MetricValue {}
    unsafe impl aya::Pod for super::TraceRecord {}
    unsafe impl aya::Pod for super::ClusterIp4Key {}
    unsafe impl aya::Pod for super::ClusterIp6Key {}
    unsafe impl aya::Pod for super::ClusterIpValue {}
    unsafe impl aya::Pod for super::SvcCidrValue {}
    unsafe impl aya::Pod for super::SrcRange4 {}
    unsafe impl aya::Pod for super::SrcRange6 {}
    unsafe impl aya::Pod for super::PinMeta {}
    unsafe impl aya::Pod for super::Affinity4Key {}
    unsafe impl aya::Pod for super::Affinity6Key {}
    unsafe impl aya::Pod for super::AffinityValue {}
    unsafe impl aya::Pod for super::AffinityMatchKey {}
}

// The sizes are part of the ABI with pinned maps: a change here needs a map migration.
const _: () = {
    assert!(size_of::<Svc4Key>() == 12);
    assert!(size_of::<Svc6Key>() == 24);
    assert!(size_of::<SvcValue>() == 20);
    assert!(size_of::<Backend4>() == 8);
    assert!(size_of::<Backend6>() == 20);
    assert!(size_of::<RevNat4>() == 8);
    assert!(size_of::<RevNat6>() == 20);
    assert!(size_of::<Ct4Key>() == 16);
    assert!(size_of::<Ct6Key>() == 40);
    assert!(size_of::<Ct4Value>() == 20);
    assert!(size_of::<Ct6Value>() == 32);
    assert!(size_of::<LbConfig>() == 28);
    assert!(size_of::<PinMeta>() == 32);
    assert!(size_of::<SkRevNat4Key>() == 16);
    assert!(size_of::<SkRevNat4Value>() == 12);
    assert!(size_of::<SkRevNat6Key>() == 32);
    assert!(size_of::<SkRevNat6Value>() == 24);
    assert!(size_of::<SkSlot4>() == 16);
    assert!(size_of::<SkSlot6>() == 40);
    assert!(size_of::<SkStore4>() == 4 + 16 * SK_STORE_SLOTS);
    assert!(size_of::<SkStore6>() == 4 + 40 * SK_STORE_SLOTS);
    assert!(size_of::<UdpGoneKey>() == 40);
    assert!(size_of::<Frag4Key>() == 16);
    assert!(size_of::<Frag6Key>() == 40);
    assert!(size_of::<FragEntry>() == 12);
    assert!(size_of::<MetricValue>() == 16);
    assert!(size_of::<TraceRecord>() == 32);
    assert!(size_of::<ClusterIp4Key>() == 4);
    assert!(size_of::<ClusterIp6Key>() == 16);
    assert!(size_of::<ClusterIpValue>() == 4);
    assert!(size_of::<SvcCidrValue>() == 4);
    assert!(size_of::<SrcRange4>() == 8);
    assert!(size_of::<SrcRange6>() == 20);
    assert!(size_of::<Affinity4Key>() == 24);
    assert!(size_of::<Affinity6Key>() == 32);
    assert!(size_of::<AffinityValue>() == 8);
    assert!(size_of::<AffinityMatchKey>() == 12);
    // `TraceRecord::reason` holds a metrics index in a u8.
    assert!(metrics::MAX <= 256);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_slot_stays_in_range_and_is_uniform() {
        for count in [1u16, 2, 3, 7, 100, u16::MAX] {
            assert_eq!(select_slot(0, count), 1);
            assert_eq!(select_slot(u32::MAX, count), count);
        }
        // Uniform over 3 slots: equal-width bands of the input space.
        let mut hits = [0u32; 4];
        let step = u32::MAX / 30_000;
        for i in 0..30_000u32 {
            hits[select_slot(i * step, 3) as usize] += 1;
        }
        assert_eq!(hits[0], 0);
        for h in &hits[1..] {
            assert!((9_900..=10_100).contains(h), "{hits:?}");
        }
    }

    #[test]
    fn mix64_spreads_sequential_cookies() {
        let mut hits = [0u32; 5];
        for cookie in 1000..11_000u64 {
            hits[select_slot(mix64(cookie), 4) as usize] += 1;
        }
        for h in &hits[1..] {
            assert!((2_300..=2_700).contains(h), "{hits:?}");
        }
    }

    #[test]
    fn flow_hash_is_fixed_and_spreads_source_ports() {
        // Pinned value: every node and every lb version must agree on a flow's hash.
        let h = flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], 40000, 80, IPPROTO_TCP);
        assert_eq!(h, 3_743_174_128);
        let v6 = flow_hash(
            &[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            &[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
            40000,
            80,
            6,
        );
        assert_eq!(v6, 120_952_210);
        assert_ne!(
            h,
            flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], 40001, 80, 6)
        );
        assert_ne!(
            h,
            flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], 40000, 80, 17)
        );
        let mut hits = [0u32; 5];
        for sport in 10_000..20_000u16 {
            let h = flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], sport, 80, 6);
            hits[select_slot(h, 4) as usize] += 1;
        }
        for h in &hits[1..] {
            assert!((2_300..=2_700).contains(h), "{hits:?}");
        }
    }

    #[test]
    fn trace_record_layout_is_packed_by_hand() {
        // Field offsets as userspace and bpftool read them; no implicit padding anywhere.
        assert_eq!(core::mem::offset_of!(TraceRecord, verdict), 0);
        assert_eq!(core::mem::offset_of!(TraceRecord, reason), 1);
        assert_eq!(core::mem::offset_of!(TraceRecord, scope), 2);
        assert_eq!(core::mem::offset_of!(TraceRecord, ct_state), 3);
        assert_eq!(core::mem::offset_of!(TraceRecord, slot), 4);
        assert_eq!(core::mem::offset_of!(TraceRecord, svc_flags), 6);
        assert_eq!(core::mem::offset_of!(TraceRecord, backend_id), 8);
        assert_eq!(core::mem::offset_of!(TraceRecord, rev_nat_id), 12);
        assert_eq!(core::mem::offset_of!(TraceRecord, masquerade), 16);
        assert_eq!(core::mem::offset_of!(TraceRecord, affinity), 17);
        assert_eq!(core::mem::offset_of!(TraceRecord, nat_port), 18);
        assert_eq!(core::mem::offset_of!(TraceRecord, maglev_cell), 20);
        assert_eq!(core::mem::offset_of!(TraceRecord, lb_alg), 24);
        assert_eq!(core::mem::offset_of!(TraceRecord, local_backend), 25);
        assert_eq!(core::mem::offset_of!(TraceRecord, ct_flags), 26);
        assert_eq!(core::mem::offset_of!(TraceRecord, frag), 28);
        assert_eq!(core::mem::offset_of!(TraceRecord, ext_headers), 29);
        assert_eq!(core::mem::offset_of!(TraceRecord, pad), 30);
        assert_eq!(size_of::<TraceRecord>(), 32);
    }

    #[test]
    fn ct_and_config_layouts_are_packed_by_hand() {
        use core::mem::offset_of;
        assert_eq!(offset_of!(Ct4Value, flags), 12);
        assert_eq!(offset_of!(Ct4Value, nat_port), 14);
        assert_eq!(offset_of!(Ct4Value, nat_addr), 16);
        assert_eq!(offset_of!(Ct6Value, nat_port), 14);
        assert_eq!(offset_of!(Ct6Value, nat_addr), 16);
        assert_eq!(offset_of!(LbConfig, node_ip6), 4);
        assert_eq!(offset_of!(LbConfig, flags), 20);
        assert_eq!(offset_of!(LbConfig, nat_port_min), 24);
        assert_eq!(offset_of!(LbConfig, nat_port_max), 26);
        assert_eq!(size_of::<PinMeta>(), 32);
        assert_eq!(offset_of!(PinMeta, netns_inode), 8);
        assert_eq!(offset_of!(PinMeta, lb_version), 16);
    }

    #[test]
    fn map_names_fit_the_kernel_limit() {
        assert!(map_names::TRACE.len() <= 15);
        for name in map_names::ALL {
            assert!(name.len() <= 15, "{name}");
        }
        for name in prog_names::ALL {
            assert!(name.len() <= 15, "{name}");
        }
    }
}
