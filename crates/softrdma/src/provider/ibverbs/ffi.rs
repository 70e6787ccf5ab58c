//! The part of libibverbs' ABI the hardware provider uses, as rdma-core's
//! `<infiniband/verbs.h>` lays it out (checked against rdma-core 44's
//! header by the tests below), and the library loaded at run time:
//! a machine without rdma-core still runs the software providers.

#![allow(non_camel_case_types, dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// Opaque.
#[repr(C)]
pub struct ibv_device {
    _private: [u8; 0],
}
/// Opaque.
#[repr(C)]
pub struct ibv_ah {
    _private: [u8; 0],
}

type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
type PostSrqRecv =
    unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
type Unused = Option<unsafe extern "C" fn()>;

/// `struct ibv_context_ops`: the data-path calls libibverbs' inline
/// functions (`ibv_post_send`, `ibv_poll_cq`, ...) make through.
#[repr(C)]
pub struct ibv_context_ops {
    _compat: [Unused; 11],
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    _compat2: [Unused; 7],
    pub post_srq_recv: Option<PostSrqRecv>,
    _compat3: [Unused; 4],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    _compat4: [Unused; 5],
}

/// `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    _mutex: [u64; 5],
    _abi_compat: *mut c_void,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    _mutex: [u64; 5],
    _cond: [u64; 6],
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_srq`.
#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    _mutex: [u64; 5],
    _cond: [u64; 6],
    pub events_completed: u32,
}

/// `struct ibv_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// `struct ibv_srq_init_attr`.
#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    _mutex: [u64; 5],
    _cond: [u64; 6],
    pub events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route`: 8-byte aligned, as its `union ibv_gid`
/// holds two 64-bit words.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma`, `wr.atomic` or `wr.ud` of `struct ibv_send_wr`, laid out as
/// the largest (atomic): remote address, compare/add, swap, rkey. `rdma`
/// puts its rkey at byte 8, `ud` its AH at 0 and QPN, Q_Key at 8 and 12.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wr_union {
    pub w0: u64,
    pub w1: u64,
    pub w2: u64,
    pub w3: u32,
}

/// `struct ibv_send_wr`.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_or_rkey: u32,
    pub wr: ibv_wr_union,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// `bind_mw` / `tso`: unused here.
    _tail: [u64; 6],
}

impl ibv_send_wr {
    /// An empty request (every field zero).
    pub fn zeroed() -> ibv_send_wr {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_or_rkey: 0,
            wr: ibv_wr_union::default(),
            remote_srqn: 0,
            _tail: [0; 6],
        }
    }
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network order) or `invalidated_rkey`.
    pub imm_or_rkey: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_async_event`.
#[repr(C)]
pub struct ibv_async_event {
    /// The CQ, QP, SRQ or port number.
    pub element: *mut c_void,
    pub event_type: c_uint,
}

pub const IBV_QPT_RC: c_uint = 2;
pub const IBV_QPT_UD: c_uint = 4;

pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_CUR_STATE: c_int = 1 << 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_QKEY: c_int = 1 << 6;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_CAP: c_int = 1 << 19;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_SEND_WITH_IMM: c_uint = 3;
pub const IBV_WR_RDMA_READ: c_uint = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_uint = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_uint = 6;
pub const IBV_WR_LOCAL_INV: c_uint = 7;
pub const IBV_WR_SEND_WITH_INV: c_uint = 9;

pub const IBV_SEND_FENCE: c_uint = 1 << 0;
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_SEND_SOLICITED: c_uint = 1 << 2;
pub const IBV_SEND_INLINE: c_uint = 1 << 3;

pub const IBV_WC_SEND: c_uint = 0;
pub const IBV_WC_RDMA_WRITE: c_uint = 1;
pub const IBV_WC_RDMA_READ: c_uint = 2;
pub const IBV_WC_COMP_SWAP: c_uint = 3;
pub const IBV_WC_FETCH_ADD: c_uint = 4;
pub const IBV_WC_LOCAL_INV: c_uint = 6;
pub const IBV_WC_RECV: c_uint = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = 129;

pub const IBV_WC_GRH: c_uint = 1 << 0;
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;
pub const IBV_WC_WITH_INV: c_uint = 1 << 3;

pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

pub const IBV_EVENT_CQ_ERR: c_uint = 0;
pub const IBV_EVENT_QP_FATAL: c_uint = 1;
pub const IBV_EVENT_QP_REQ_ERR: c_uint = 2;
pub const IBV_EVENT_QP_ACCESS_ERR: c_uint = 3;
pub const IBV_EVENT_COMM_EST: c_uint = 4;
pub const IBV_EVENT_SQ_DRAINED: c_uint = 5;
pub const IBV_EVENT_DEVICE_FATAL: c_uint = 8;
pub const IBV_EVENT_PORT_ACTIVE: c_uint = 9;
pub const IBV_EVENT_PORT_ERR: c_uint = 10;
pub const IBV_EVENT_SRQ_LIMIT_REACHED: c_uint = 15;
pub const IBV_EVENT_QP_LAST_WQE_REACHED: c_uint = 16;

pub const IBV_SRQ_LIMIT: c_int = 1 << 1;

/// The library's entry points this provider calls (the data path goes
/// through [`ibv_context_ops`] instead, as libibverbs' inline functions do).
pub struct Lib {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut [u8; 16]) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub query_qp:
        unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub create_srq: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq,
    pub modify_srq: unsafe extern "C" fn(*mut ibv_srq, *mut ibv_srq_attr, c_int) -> c_int,
    pub destroy_srq: unsafe extern "C" fn(*mut ibv_srq) -> c_int,
    pub create_ah: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah,
    pub destroy_ah: unsafe extern "C" fn(*mut ibv_ah) -> c_int,
    pub get_async_event: unsafe extern "C" fn(*mut ibv_context, *mut ibv_async_event) -> c_int,
    pub ack_async_event: unsafe extern "C" fn(*mut ibv_async_event),
    /// Kept loaded for the process's life: the pointers above point into it.
    _lib: libloading::Library,
}

impl Lib {
    /// Loads `libibverbs.so.1` and looks up every entry point.
    pub fn load() -> Result<Lib, String> {
        // SAFETY: loading rdma-core's libibverbs runs its initialisers,
        // which only read the environment and /sys; it is a C library made
        // to be loaded into any process.
        let lib = unsafe { libloading::Library::new("libibverbs.so.1") }.map_err(|e| {
            format!(
                "cannot load libibverbs.so.1 ({e}): install rdma-core's libibverbs1 \
                 and ibverbs-providers"
            )
        })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is libibverbs' exported function of
                // this name; the field's type is its C prototype from
                // rdma-core's verbs.h.
                let s = unsafe { lib.get($name.as_bytes()) }
                    .map_err(|e| format!("libibverbs.so.1 has no {}: {e}", $name))?;
                *s
            }};
        }
        Ok(Lib {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_device: sym!("ibv_query_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_comp_channel: sym!("ibv_create_comp_channel"),
            destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            get_cq_event: sym!("ibv_get_cq_event"),
            ack_cq_events: sym!("ibv_ack_cq_events"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            query_qp: sym!("ibv_query_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            create_srq: sym!("ibv_create_srq"),
            modify_srq: sym!("ibv_modify_srq"),
            destroy_srq: sym!("ibv_destroy_srq"),
            create_ah: sym!("ibv_create_ah"),
            destroy_ah: sym!("ibv_destroy_ah"),
            get_async_event: sym!("ibv_get_async_event"),
            ack_async_event: sym!("ibv_ack_async_event"),
            _lib: lib,
        })
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// (C expression, Rust's figure, rdma-core 44's figure on x86-64).
    fn layout() -> Vec<(&'static str, usize, usize)> {
        let ops = offset_of!(ibv_context, ops);
        vec![
            ("sizeof(struct ibv_context)", size_of::<ibv_context>(), 328),
            (
                "offsetof(struct ibv_context, cmd_fd)",
                offset_of!(ibv_context, cmd_fd),
                264,
            ),
            (
                "offsetof(struct ibv_context, async_fd)",
                offset_of!(ibv_context, async_fd),
                268,
            ),
            (
                "offsetof(struct ibv_context, ops.poll_cq)",
                ops + offset_of!(ibv_context_ops, poll_cq),
                96,
            ),
            (
                "offsetof(struct ibv_context, ops.req_notify_cq)",
                ops + offset_of!(ibv_context_ops, req_notify_cq),
                104,
            ),
            (
                "offsetof(struct ibv_context, ops.post_srq_recv)",
                ops + offset_of!(ibv_context_ops, post_srq_recv),
                168,
            ),
            (
                "offsetof(struct ibv_context, ops.post_send)",
                ops + offset_of!(ibv_context_ops, post_send),
                208,
            ),
            (
                "offsetof(struct ibv_context, ops.post_recv)",
                ops + offset_of!(ibv_context_ops, post_recv),
                216,
            ),
            (
                "sizeof(struct ibv_device_attr)",
                size_of::<ibv_device_attr>(),
                232,
            ),
            (
                "offsetof(struct ibv_device_attr, max_mr_size)",
                offset_of!(ibv_device_attr, max_mr_size),
                80,
            ),
            (
                "offsetof(struct ibv_device_attr, max_qp)",
                offset_of!(ibv_device_attr, max_qp),
                108,
            ),
            (
                "offsetof(struct ibv_device_attr, max_cqe)",
                offset_of!(ibv_device_attr, max_cqe),
                132,
            ),
            (
                "offsetof(struct ibv_device_attr, atomic_cap)",
                offset_of!(ibv_device_attr, atomic_cap),
                164,
            ),
            (
                "offsetof(struct ibv_device_attr, max_srq_sge)",
                offset_of!(ibv_device_attr, max_srq_sge),
                220,
            ),
            (
                "offsetof(struct ibv_device_attr, phys_port_cnt)",
                offset_of!(ibv_device_attr, phys_port_cnt),
                227,
            ),
            (
                "sizeof(struct ibv_port_attr)",
                size_of::<ibv_port_attr>(),
                52,
            ),
            (
                "offsetof(struct ibv_port_attr, gid_tbl_len)",
                offset_of!(ibv_port_attr, gid_tbl_len),
                12,
            ),
            (
                "offsetof(struct ibv_port_attr, max_msg_sz)",
                offset_of!(ibv_port_attr, max_msg_sz),
                20,
            ),
            (
                "offsetof(struct ibv_port_attr, link_layer)",
                offset_of!(ibv_port_attr, link_layer),
                46,
            ),
            ("sizeof(struct ibv_pd)", size_of::<ibv_pd>(), 16),
            ("sizeof(struct ibv_mr)", size_of::<ibv_mr>(), 48),
            (
                "offsetof(struct ibv_mr, lkey)",
                offset_of!(ibv_mr, lkey),
                36,
            ),
            (
                "offsetof(struct ibv_mr, rkey)",
                offset_of!(ibv_mr, rkey),
                40,
            ),
            (
                "sizeof(struct ibv_comp_channel)",
                size_of::<ibv_comp_channel>(),
                16,
            ),
            (
                "offsetof(struct ibv_comp_channel, fd)",
                offset_of!(ibv_comp_channel, fd),
                8,
            ),
            ("sizeof(struct ibv_cq)", size_of::<ibv_cq>(), 128),
            (
                "offsetof(struct ibv_cq, cq_context)",
                offset_of!(ibv_cq, cq_context),
                16,
            ),
            ("sizeof(struct ibv_srq)", size_of::<ibv_srq>(), 128),
            (
                "offsetof(struct ibv_srq, srq_context)",
                offset_of!(ibv_srq, srq_context),
                8,
            ),
            (
                "sizeof(struct ibv_srq_init_attr)",
                size_of::<ibv_srq_init_attr>(),
                24,
            ),
            ("sizeof(struct ibv_qp)", size_of::<ibv_qp>(), 160),
            (
                "offsetof(struct ibv_qp, qp_num)",
                offset_of!(ibv_qp, qp_num),
                52,
            ),
            (
                "sizeof(struct ibv_qp_init_attr)",
                size_of::<ibv_qp_init_attr>(),
                64,
            ),
            (
                "offsetof(struct ibv_qp_init_attr, cap)",
                offset_of!(ibv_qp_init_attr, cap),
                32,
            ),
            (
                "offsetof(struct ibv_qp_init_attr, qp_type)",
                offset_of!(ibv_qp_init_attr, qp_type),
                52,
            ),
            ("sizeof(struct ibv_ah_attr)", size_of::<ibv_ah_attr>(), 32),
            (
                "_Alignof(struct ibv_ah_attr)",
                std::mem::align_of::<ibv_ah_attr>(),
                8,
            ),
            (
                "_Alignof(struct ibv_qp_attr)",
                std::mem::align_of::<ibv_qp_attr>(),
                8,
            ),
            (
                "_Alignof(struct ibv_port_attr)",
                std::mem::align_of::<ibv_port_attr>(),
                4,
            ),
            (
                "_Alignof(struct ibv_device_attr)",
                std::mem::align_of::<ibv_device_attr>(),
                8,
            ),
            (
                "_Alignof(struct ibv_qp_cap)",
                std::mem::align_of::<ibv_qp_cap>(),
                4,
            ),
            (
                "_Alignof(struct ibv_srq_attr)",
                std::mem::align_of::<ibv_srq_attr>(),
                4,
            ),
            (
                "_Alignof(struct ibv_send_wr)",
                std::mem::align_of::<ibv_send_wr>(),
                8,
            ),
            ("_Alignof(struct ibv_wc)", std::mem::align_of::<ibv_wc>(), 8),
            (
                "_Alignof(struct ibv_sge)",
                std::mem::align_of::<ibv_sge>(),
                8,
            ),
            (
                "offsetof(struct ibv_ah_attr, dlid)",
                offset_of!(ibv_ah_attr, dlid),
                24,
            ),
            (
                "offsetof(struct ibv_ah_attr, is_global)",
                offset_of!(ibv_ah_attr, is_global),
                29,
            ),
            (
                "offsetof(struct ibv_global_route, sgid_index)",
                offset_of!(ibv_global_route, sgid_index),
                20,
            ),
            ("sizeof(struct ibv_qp_attr)", size_of::<ibv_qp_attr>(), 144),
            (
                "offsetof(struct ibv_qp_attr, qkey)",
                offset_of!(ibv_qp_attr, qkey),
                16,
            ),
            (
                "offsetof(struct ibv_qp_attr, qp_access_flags)",
                offset_of!(ibv_qp_attr, qp_access_flags),
                32,
            ),
            (
                "offsetof(struct ibv_qp_attr, ah_attr)",
                offset_of!(ibv_qp_attr, ah_attr),
                56,
            ),
            (
                "offsetof(struct ibv_qp_attr, pkey_index)",
                offset_of!(ibv_qp_attr, pkey_index),
                120,
            ),
            (
                "offsetof(struct ibv_qp_attr, max_rd_atomic)",
                offset_of!(ibv_qp_attr, max_rd_atomic),
                126,
            ),
            (
                "offsetof(struct ibv_qp_attr, port_num)",
                offset_of!(ibv_qp_attr, port_num),
                129,
            ),
            (
                "offsetof(struct ibv_qp_attr, rnr_retry)",
                offset_of!(ibv_qp_attr, rnr_retry),
                132,
            ),
            (
                "offsetof(struct ibv_qp_attr, rate_limit)",
                offset_of!(ibv_qp_attr, rate_limit),
                136,
            ),
            ("sizeof(struct ibv_sge)", size_of::<ibv_sge>(), 16),
            ("sizeof(struct ibv_send_wr)", size_of::<ibv_send_wr>(), 128),
            (
                "offsetof(struct ibv_send_wr, opcode)",
                offset_of!(ibv_send_wr, opcode),
                28,
            ),
            (
                "offsetof(struct ibv_send_wr, imm_data)",
                offset_of!(ibv_send_wr, imm_or_rkey),
                36,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)",
                offset_of!(ibv_send_wr, wr),
                40,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.rdma.rkey)",
                offset_of!(ibv_send_wr, wr) + offset_of!(ibv_wr_union, w1),
                48,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.atomic.compare_add)",
                offset_of!(ibv_send_wr, wr) + offset_of!(ibv_wr_union, w1),
                48,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.atomic.swap)",
                offset_of!(ibv_send_wr, wr) + offset_of!(ibv_wr_union, w2),
                56,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.atomic.rkey)",
                offset_of!(ibv_send_wr, wr) + offset_of!(ibv_wr_union, w3),
                64,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.ud.remote_qpn)",
                offset_of!(ibv_send_wr, wr) + offset_of!(ibv_wr_union, w1),
                48,
            ),
            (
                "offsetof(struct ibv_send_wr, wr.ud.remote_qkey)",
                offset_of!(ibv_send_wr, wr) + offset_of!(ibv_wr_union, w1) + 4,
                52,
            ),
            (
                "offsetof(struct ibv_send_wr, qp_type)",
                offset_of!(ibv_send_wr, remote_srqn),
                72,
            ),
            ("sizeof(struct ibv_recv_wr)", size_of::<ibv_recv_wr>(), 32),
            ("sizeof(struct ibv_wc)", size_of::<ibv_wc>(), 48),
            (
                "offsetof(struct ibv_wc, byte_len)",
                offset_of!(ibv_wc, byte_len),
                20,
            ),
            (
                "offsetof(struct ibv_wc, imm_data)",
                offset_of!(ibv_wc, imm_or_rkey),
                24,
            ),
            (
                "offsetof(struct ibv_wc, wc_flags)",
                offset_of!(ibv_wc, wc_flags),
                36,
            ),
            ("offsetof(struct ibv_wc, sl)", offset_of!(ibv_wc, sl), 44),
            (
                "sizeof(struct ibv_async_event)",
                size_of::<ibv_async_event>(),
                16,
            ),
            (
                "offsetof(struct ibv_async_event, event_type)",
                offset_of!(ibv_async_event, event_type),
                8,
            ),
        ]
    }

    #[test]
    fn the_layouts_are_rdma_core_44s() {
        for (expr, rust, recorded) in layout() {
            assert_eq!(rust, recorded, "{expr}");
        }
    }

    /// Where libibverbs' header is installed (libibverbs-dev; CI installs
    /// it), each figure against what the C compiler makes of it.
    #[test]
    fn the_layouts_match_the_installed_verbs_h() {
        let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
        if !header.exists() {
            eprintln!(
                "skipped: no {} (apt install libibverbs-dev)",
                header.display()
            );
            return;
        }
        let dir = std::env::temp_dir().join(format!("softrdma-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = String::from(
            "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
        );
        for (expr, _, _) in layout() {
            c += &format!("printf(\"%zu\\n\", (size_t){expr});\n");
        }
        c += "return 0; }\n";
        std::fs::write(dir.join("abi.c"), c).unwrap();
        let built = std::process::Command::new("cc")
            .args(["-o", "abi", "abi.c"])
            .current_dir(&dir)
            .status()
            .expect("a C compiler (cc) beside the header");
        assert!(built.success(), "the layout program did not compile");
        let out = std::process::Command::new(dir.join("abi"))
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let figures: Vec<usize> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        let table = layout();
        assert_eq!(figures.len(), table.len());
        for ((expr, rust, _), c) in table.iter().zip(figures) {
            assert_eq!(*rust, c, "{expr}: Rust {rust}, C {c}");
        }
    }
}
