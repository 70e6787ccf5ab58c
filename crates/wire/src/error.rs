use core::fmt;

/// Why a byte string is not a valid header or packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The buffer ends before the header or packet does.
    Truncated {
        /// What was being parsed.
        header: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes there are.
        available: usize,
    },
    /// An InfiniBand BTH opcode that RC, UC, UD and CNP do not define.
    UnknownOpcode(u8),
    /// An RDMAP opcode that RFC 5040 does not define.
    UnknownRdmapOpcode(u8),
    /// A version field this crate does not speak (BTH TVer, DDP, RDMAP, MPA, MAD).
    UnsupportedVersion {
        /// The version field.
        field: &'static str,
        /// Its value.
        value: u8,
    },
    /// A field holds a value its format forbids.
    InvalidField {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The RoCEv2 invariant CRC does not match the packet.
    BadIcrc {
        /// Computed over the packet.
        computed: u32,
        /// Carried by the packet.
        carried: u32,
    },
    /// The MPA CRC32c does not match the FPDU.
    BadCrc32c {
        /// Computed over the FPDU.
        computed: u32,
        /// Carried by the FPDU.
        carried: u32,
    },
    /// The first 16 bytes of an MPA start frame are neither "MPA ID Req Frame" nor "MPA ID Rep Frame".
    BadMpaKey,
}

/// The result type of this crate.
pub type Result<T> = core::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::Truncated {
                header,
                needed,
                available,
            } => write!(
                f,
                "truncated {header}: needs {needed} bytes, {available} available"
            ),
            Error::UnknownOpcode(op) => write!(f, "unknown InfiniBand opcode {op:#04x}"),
            Error::UnknownRdmapOpcode(op) => write!(f, "unknown RDMAP opcode {op:#x}"),
            Error::UnsupportedVersion { field, value } => {
                write!(f, "unsupported {field} {value}")
            }
            Error::InvalidField { field, value } => write!(f, "invalid {field} {value:#x}"),
            Error::BadIcrc { computed, carried } => write!(
                f,
                "bad ICRC: carried {carried:#010x}, computed {computed:#010x}"
            ),
            Error::BadCrc32c { computed, carried } => write!(
                f,
                "bad MPA CRC32c: carried {carried:#010x}, computed {computed:#010x}"
            ),
            Error::BadMpaKey => f.write_str("not an MPA request or reply frame (bad key)"),
        }
    }
}

impl std::error::Error for Error {}
