//! Queue pair states and the attributes each transition needs, as libibverbs'
//! `ibv_modify_qp` and the kernel's `ib_modify_qp_is_ok` table have them.

use std::fmt;

use crate::memory::Access;

/// QP states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QpState {
    /// Just created or reset: nothing is processed.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained: sends posted wait.
    Sqd,
    /// Send queue error (UC/UD only).
    Sqe,
    /// Error: everything outstanding is flushed.
    Err,
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Sqd => "SQD",
            QpState::Sqe => "SQE",
            QpState::Err => "ERR",
        })
    }
}

/// Transport service type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable datagram.
    Ud,
}

/// IB path MTUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// Bytes.
    pub const fn bytes(self) -> usize {
        128 << (self as usize)
    }
    /// The MTU of a byte count, if it is one of the five.
    pub const fn from_bytes(n: usize) -> Option<Mtu> {
        Some(match n {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }
    /// Its `ibv_mtu` code (1..=5).
    pub const fn code(self) -> u8 {
        self as u8
    }
    /// The MTU of an `ibv_mtu` code (1..=5).
    pub const fn from_code(c: u8) -> Option<Mtu> {
        Some(match c {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }
    /// The largest IB MTU that fits a link MTU, as rxe picks its active MTU
    /// (link MTU minus its 80-byte header allowance).
    pub fn for_link(link_mtu: usize) -> Mtu {
        let room = link_mtu.saturating_sub(80);
        [Mtu::Mtu4096, Mtu::Mtu2048, Mtu::Mtu1024, Mtu::Mtu512]
            .into_iter()
            .find(|m| m.bytes() <= room)
            .unwrap_or(Mtu::Mtu256)
    }
}

/// Attributes for a state transition; `None` means "not given" (the libibverbs
/// attribute mask is which fields are `Some`). The address vector is the
/// provider's business and is given separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// The state to move to.
    pub state: Option<QpState>,
    /// The state the caller believes the QP is in.
    pub cur_state: Option<QpState>,
    /// Partition key index.
    pub pkey_index: Option<u16>,
    /// Port number (1).
    pub port: Option<u8>,
    /// Remote access the QP allows (REMOTE_WRITE/READ/ATOMIC).
    pub access: Option<Access>,
    /// Path MTU.
    pub path_mtu: Option<Mtu>,
    /// The peer's QP number.
    pub dest_qp: Option<u32>,
    /// First PSN the responder expects.
    pub rq_psn: Option<u32>,
    /// First PSN the requester sends.
    pub sq_psn: Option<u32>,
    /// READ/atomic requests the responder serves at once (IRD).
    pub max_dest_rd_atomic: Option<u8>,
    /// READ/atomic requests the requester keeps outstanding (ORD).
    pub max_rd_atomic: Option<u8>,
    /// RNR NAK timer code the responder sends (0..=31).
    pub min_rnr_timer: Option<u8>,
    /// Local ACK timeout: 4.096 us * 2^timeout; 0 = no timer (0..=31).
    pub timeout: Option<u8>,
    /// Retransmissions before RETRY_EXC_ERR (0..=7).
    pub retry_cnt: Option<u8>,
    /// RNR retries before RNR_RETRY_EXC_ERR (0..=7, 7 = forever).
    pub rnr_retry: Option<u8>,
    /// Q_Key (UD).
    pub qkey: Option<u32>,
    /// An address vector is given (RTR needs one for RC).
    pub has_av: bool,
}

// Bits of the attribute mask, to state what a transition needs.
const STATE: u32 = 1 << 0;
const CUR_STATE: u32 = 1 << 1;
const PKEY: u32 = 1 << 2;
const PORT: u32 = 1 << 3;
const ACCESS: u32 = 1 << 4;
const PATH_MTU: u32 = 1 << 5;
const DEST_QP: u32 = 1 << 6;
const RQ_PSN: u32 = 1 << 7;
const SQ_PSN: u32 = 1 << 8;
const MAX_DEST_RD: u32 = 1 << 9;
const MAX_RD: u32 = 1 << 10;
const MIN_RNR: u32 = 1 << 11;
const TIMEOUT: u32 = 1 << 12;
const RETRY: u32 = 1 << 13;
const RNR_RETRY: u32 = 1 << 14;
const QKEY: u32 = 1 << 15;
const AV: u32 = 1 << 16;

const NAMES: [(u32, &str); 17] = [
    (STATE, "qp_state"),
    (CUR_STATE, "cur_qp_state"),
    (PKEY, "pkey_index"),
    (PORT, "port_num"),
    (ACCESS, "qp_access_flags"),
    (PATH_MTU, "path_mtu"),
    (DEST_QP, "dest_qp_num"),
    (RQ_PSN, "rq_psn"),
    (SQ_PSN, "sq_psn"),
    (MAX_DEST_RD, "max_dest_rd_atomic"),
    (MAX_RD, "max_rd_atomic"),
    (MIN_RNR, "min_rnr_timer"),
    (TIMEOUT, "timeout"),
    (RETRY, "retry_cnt"),
    (RNR_RETRY, "rnr_retry"),
    (QKEY, "qkey"),
    (AV, "ah_attr"),
];

fn names(m: u32) -> String {
    NAMES
        .iter()
        .filter(|(b, _)| m & b != 0)
        .map(|(_, n)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

impl QpAttr {
    fn mask(&self) -> u32 {
        let mut m = 0;
        let mut set = |on: bool, bit: u32| {
            if on {
                m |= bit;
            }
        };
        set(self.state.is_some(), STATE);
        set(self.cur_state.is_some(), CUR_STATE);
        set(self.pkey_index.is_some(), PKEY);
        set(self.port.is_some(), PORT);
        set(self.access.is_some(), ACCESS);
        set(self.path_mtu.is_some(), PATH_MTU);
        set(self.dest_qp.is_some(), DEST_QP);
        set(self.rq_psn.is_some(), RQ_PSN);
        set(self.sq_psn.is_some(), SQ_PSN);
        set(self.max_dest_rd_atomic.is_some(), MAX_DEST_RD);
        set(self.max_rd_atomic.is_some(), MAX_RD);
        set(self.min_rnr_timer.is_some(), MIN_RNR);
        set(self.timeout.is_some(), TIMEOUT);
        set(self.retry_cnt.is_some(), RETRY);
        set(self.rnr_retry.is_some(), RNR_RETRY);
        set(self.qkey.is_some(), QKEY);
        set(self.has_av, AV);
        m
    }
}

/// Why a modify is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The transition does not exist.
    #[error("a {qp_type:?} queue pair cannot go from {from} to {to}")]
    Illegal {
        /// QP type.
        qp_type: QpType,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Attributes the transition needs are missing.
    #[error("{from} -> {to} needs {missing}")]
    Missing {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The missing attributes.
        missing: String,
    },
    /// Attributes the transition does not take.
    #[error("{from} -> {to} does not take {extra}")]
    NotAllowed {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// The extra attributes.
        extra: String,
    },
    /// The caller's idea of the current state is wrong.
    #[error("cur_qp_state {given} given, but the queue pair is in {actual}")]
    WrongCurrentState {
        /// Given.
        given: QpState,
        /// Actual.
        actual: QpState,
    },
    /// A value out of range.
    #[error("{attr} = {value} is out of range ({range})")]
    OutOfRange {
        /// Attribute.
        attr: &'static str,
        /// Value.
        value: u64,
        /// Allowed values.
        range: &'static str,
    },
}

/// (required, optional) attributes of a transition for a QP type, or `None`.
fn table(t: QpType, from: QpState, to: QpState) -> Option<(u32, u32)> {
    use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
    let rc = t == QpType::Rc;
    Some(match (from, to) {
        (_, Reset) | (_, QpState::Err) => (0, 0),
        (Reset, Init) if rc => (PKEY | PORT | ACCESS, 0),
        (Reset, Init) => (PKEY | PORT | QKEY, 0),
        (Init, Init) if rc => (0, PKEY | PORT | ACCESS),
        (Init, Init) => (0, PKEY | PORT | QKEY),
        (Init, Rtr) if rc => (
            AV | PATH_MTU | DEST_QP | RQ_PSN | MAX_DEST_RD | MIN_RNR,
            ACCESS | PKEY,
        ),
        (Init, Rtr) => (0, PKEY | QKEY),
        (Rtr, Rts) if rc => (
            SQ_PSN | MAX_RD | RETRY | RNR_RETRY | TIMEOUT,
            CUR_STATE | ACCESS | MIN_RNR,
        ),
        (Rtr, Rts) => (SQ_PSN, CUR_STATE | QKEY),
        (Rts, Rts) if rc => (0, CUR_STATE | ACCESS | MIN_RNR),
        (Rts, Rts) => (0, CUR_STATE | QKEY),
        (Rts, Sqd) => (0, 0),
        (Sqd, Rts) if rc => (0, CUR_STATE | ACCESS | MIN_RNR),
        (Sqd, Rts) => (0, CUR_STATE | QKEY),
        (Sqd, Sqd) if rc => (
            0,
            AV | PKEY
                | PORT
                | ACCESS
                | MAX_RD
                | MAX_DEST_RD
                | MIN_RNR
                | TIMEOUT
                | RETRY
                | RNR_RETRY,
        ),
        (Sqd, Sqd) => (0, PKEY | QKEY),
        (Sqe, Rts) if !rc => (0, CUR_STATE | QKEY),
        _ => return None,
    })
}

/// Whether IBV_EVENT_SQ_DRAINED is owed after a move from `from` to `to`,
/// `owed` telling whether it was before: once per move from RTS to SQD,
/// until raised or SQD is left.
pub(crate) fn sq_drain_owed(owed: bool, from: QpState, to: QpState) -> bool {
    to == QpState::Sqd && (owed || from == QpState::Rts)
}

/// Most READ/atomic requests in flight in either direction (rxe allows 128).
pub const MAX_RD_ATOMIC: u8 = 128;

/// Checks a modify against the state table and the attributes' ranges.
pub fn check_transition(
    t: QpType,
    cur: QpState,
    attr: &QpAttr,
) -> Result<QpState, TransitionError> {
    let to = attr.state.unwrap_or(cur);
    if let Some(given) = attr.cur_state
        && given != cur
    {
        return Err(TransitionError::WrongCurrentState { given, actual: cur });
    }
    let (required, optional) = table(t, cur, to).ok_or(TransitionError::Illegal {
        qp_type: t,
        from: cur,
        to,
    })?;
    let given = attr.mask() & !STATE;
    let missing = required & !given;
    if missing != 0 {
        return Err(TransitionError::Missing {
            from: cur,
            to,
            missing: names(missing),
        });
    }
    let extra = given & !(required | optional | CUR_STATE);
    if extra != 0 {
        return Err(TransitionError::NotAllowed {
            from: cur,
            to,
            extra: names(extra),
        });
    }
    let range = |attr: &'static str, v: Option<u8>, max: u8, range: &'static str| match v {
        Some(v) if v > max => Err(TransitionError::OutOfRange {
            attr,
            value: v.into(),
            range,
        }),
        _ => Ok(()),
    };
    range("timeout", attr.timeout, 31, "0..=31")?;
    range("retry_cnt", attr.retry_cnt, 7, "0..=7")?;
    range("rnr_retry", attr.rnr_retry, 7, "0..=7")?;
    range("min_rnr_timer", attr.min_rnr_timer, 31, "0..=31")?;
    range("port_num", attr.port.map(|p| p.wrapping_sub(1)), 0, "1")?;
    range(
        "max_rd_atomic",
        attr.max_rd_atomic,
        MAX_RD_ATOMIC,
        "0..=128",
    )?;
    range(
        "max_dest_rd_atomic",
        attr.max_dest_rd_atomic,
        MAX_RD_ATOMIC,
        "0..=128",
    )?;
    for (name, v) in [
        ("rq_psn", attr.rq_psn),
        ("sq_psn", attr.sq_psn),
        ("dest_qp_num", attr.dest_qp),
    ] {
        if let Some(v) = v
            && v > 0xff_ffff
        {
            return Err(TransitionError::OutOfRange {
                attr: name,
                value: v.into(),
                range: "24 bits",
            });
        }
    }
    if attr.pkey_index.is_some_and(|i| i != 0) {
        return Err(TransitionError::OutOfRange {
            attr: "pkey_index",
            value: attr.pkey_index.unwrap_or(0).into(),
            range: "0 (one partition, P_Key 0xffff)",
        });
    }
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
    const ERR: QpState = QpState::Err;

    fn init() -> QpAttr {
        QpAttr {
            state: Some(Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::REMOTE_WRITE),
            ..QpAttr::default()
        }
    }

    fn rtr() -> QpAttr {
        QpAttr {
            state: Some(Rtr),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qp: Some(0x12),
            rq_psn: Some(0),
            max_dest_rd_atomic: Some(1),
            min_rnr_timer: Some(12),
            has_av: true,
            ..QpAttr::default()
        }
    }

    fn rts() -> QpAttr {
        QpAttr {
            state: Some(Rts),
            sq_psn: Some(0),
            max_rd_atomic: Some(1),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            timeout: Some(14),
            ..QpAttr::default()
        }
    }

    #[test]
    fn the_rc_path() {
        let t = QpType::Rc;
        assert_eq!(check_transition(t, Reset, &init()), Ok(Init));
        assert_eq!(check_transition(t, Init, &rtr()), Ok(Rtr));
        assert_eq!(check_transition(t, Rtr, &rts()), Ok(Rts));
        let sqd = QpAttr {
            state: Some(Sqd),
            ..QpAttr::default()
        };
        assert_eq!(check_transition(t, Rts, &sqd), Ok(Sqd));
        let back = QpAttr {
            state: Some(Rts),
            min_rnr_timer: Some(3),
            ..QpAttr::default()
        };
        assert_eq!(check_transition(t, Sqd, &back), Ok(Rts));
        for from in [Reset, Init, Rtr, Rts, Sqd, ERR] {
            for to in [Reset, ERR] {
                let a = QpAttr {
                    state: Some(to),
                    ..QpAttr::default()
                };
                assert_eq!(check_transition(t, from, &a), Ok(to));
            }
        }
    }

    #[test]
    fn invalid_transitions() {
        let t = QpType::Rc;
        assert!(matches!(
            check_transition(t, Reset, &rtr()),
            Err(TransitionError::Illegal { .. })
        ));
        assert!(matches!(
            check_transition(t, Init, &rts()),
            Err(TransitionError::Illegal { .. })
        ));
        let to_sqe = QpAttr {
            state: Some(Sqe),
            ..QpAttr::default()
        };
        assert!(check_transition(t, Rts, &to_sqe).is_err());
        let mut a = rtr();
        a.dest_qp = None;
        a.has_av = false;
        let e = check_transition(t, Init, &a).unwrap_err();
        assert_eq!(e.to_string(), "INIT -> RTR needs dest_qp_num, ah_attr");
        let mut a = init();
        a.sq_psn = Some(1);
        let e = check_transition(t, Reset, &a).unwrap_err();
        assert_eq!(e.to_string(), "RESET -> INIT does not take sq_psn");
        let mut a = rts();
        a.retry_cnt = Some(8);
        assert!(matches!(
            check_transition(t, Rtr, &a),
            Err(TransitionError::OutOfRange {
                attr: "retry_cnt",
                ..
            })
        ));
        let mut a = rts();
        a.cur_state = Some(Init);
        assert!(matches!(
            check_transition(t, Rtr, &a),
            Err(TransitionError::WrongCurrentState { .. })
        ));
        let mut a = rtr();
        a.rq_psn = Some(1 << 24);
        assert!(check_transition(t, Init, &a).is_err());
        let mut a = init();
        a.port = Some(2);
        assert!(check_transition(t, Reset, &a).is_err());
    }

    #[test]
    fn mtus() {
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::for_link(1500), Mtu::Mtu1024);
        assert_eq!(Mtu::for_link(4200), Mtu::Mtu4096);
        assert_eq!(Mtu::for_link(4096), Mtu::Mtu2048);
        assert_eq!(Mtu::for_link(65536), Mtu::Mtu4096);
        assert_eq!(Mtu::from_code(3), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::from_bytes(300), None);
    }
}
