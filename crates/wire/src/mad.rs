//! The common header of management datagrams (IBTA 13.4.3), 24 bytes at the
//! start of every MAD: the IB connection manager's messages (REQ, REP, RTU,
//! DREQ, ...) travel as UD SENDs to QP1 with such a header.

use core::fmt;

use crate::bytes::{get_u16, get_u32, get_u64, set_u16, set_u32, set_u64};
use crate::{Error, Result};

mod field {
    use crate::bytes::Field;
    pub const BASE_VERSION: usize = 0;
    pub const MGMT_CLASS: usize = 1;
    pub const CLASS_VERSION: usize = 2;
    /// R (7), Method (6-0).
    pub const METHOD: usize = 3;
    pub const STATUS: Field = 4..6;
    pub const CLASS_SPECIFIC: Field = 6..8;
    pub const TRANSACTION_ID: Field = 8..16;
    pub const ATTRIBUTE_ID: Field = 16..18;
    pub const RESERVED: Field = 18..20;
    pub const ATTRIBUTE_MODIFIER: Field = 20..24;
}

/// Length of the common MAD header.
pub const HEADER_LEN: usize = 24;
/// Length of a whole MAD.
pub const MAD_LEN: usize = 256;
/// The MAD base version in use.
pub const BASE_VERSION: u8 = 1;
/// Management class of the communication manager.
pub const CLASS_CM: u8 = 0x07;

/// The CM's class version (IBTA 12.6).
pub const CM_CLASS_VERSION: u8 = 2;
/// The Send method: every CM message.
pub const METHOD_SEND: u8 = 0x03;
/// CM REQ attribute ID.
pub const CM_REQ: u16 = 0x0010;
/// CM REJ attribute ID.
pub const CM_REJ: u16 = 0x0012;
/// A name for a management class.
pub fn class_name(class: u8) -> Option<&'static str> {
    Some(match class {
        0x01 => "SM",
        0x81 => "SM directed route",
        0x03 => "SA",
        0x04 => "PerfMgt",
        0x05 => "BM",
        0x06 => "DevMgt",
        0x07 => "CM",
        0x08 => "SNMP",
        _ => return None,
    })
}

/// A name for a CM attribute (message type).
pub fn cm_attribute_name(attr: u16) -> Option<&'static str> {
    Some(match attr {
        CM_REQ => "REQ",
        0x0011 => "MRA",
        CM_REJ => "REJ",
        0x0013 => "REP",
        0x0014 => "RTU",
        0x0015 => "DREQ",
        0x0016 => "DREP",
        0x0017 => "SIDR_REQ",
        0x0018 => "SIDR_REP",
        0x0019 => "LAP",
        0x001a => "APR",
        0x001b => "SAP",
        0x001c => "SPR",
        0x0001 => "ClassPortInfo",
        _ => return None,
    })
}

/// A name for a method.
pub fn method_name(method: u8) -> Option<&'static str> {
    Some(match method {
        0x01 => "Get",
        0x02 => "Set",
        0x03 => "Send",
        0x05 => "Trap",
        0x06 => "Report",
        0x07 => "TrapRepress",
        0x81 => "GetResp",
        0x86 => "ReportResp",
        _ => return None,
    })
}

crate::bytes::fixed_header_view!(
    /// A view of a MAD header.
    Header, "MAD header", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// Base version.
    pub fn base_version(&self) -> u8 {
        self.buffer.as_ref()[field::BASE_VERSION]
    }
    /// Management class.
    pub fn mgmt_class(&self) -> u8 {
        self.buffer.as_ref()[field::MGMT_CLASS]
    }
    /// Class version.
    pub fn class_version(&self) -> u8 {
        self.buffer.as_ref()[field::CLASS_VERSION]
    }
    /// Method, with the response bit (bit 7).
    pub fn method(&self) -> u8 {
        self.buffer.as_ref()[field::METHOD]
    }
    /// Status.
    pub fn status(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::STATUS)
    }
    /// Class-specific field.
    pub fn class_specific(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::CLASS_SPECIFIC)
    }
    /// Transaction ID.
    pub fn transaction_id(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::TRANSACTION_ID)
    }
    /// Attribute ID.
    pub fn attribute_id(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::ATTRIBUTE_ID)
    }
    /// The reserved 16 bits.
    pub fn reserved(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::RESERVED)
    }
    /// Attribute modifier.
    pub fn attribute_modifier(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::ATTRIBUTE_MODIFIER)
    }
    /// The MAD data after the header.
    pub fn data(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets the base version.
    pub fn set_base_version(&mut self, v: u8) {
        self.buffer.as_mut()[field::BASE_VERSION] = v;
    }
    /// Sets the management class.
    pub fn set_mgmt_class(&mut self, v: u8) {
        self.buffer.as_mut()[field::MGMT_CLASS] = v;
    }
    /// Sets the class version.
    pub fn set_class_version(&mut self, v: u8) {
        self.buffer.as_mut()[field::CLASS_VERSION] = v;
    }
    /// Sets the method (with the response bit).
    pub fn set_method(&mut self, v: u8) {
        self.buffer.as_mut()[field::METHOD] = v;
    }
    /// Sets the status.
    pub fn set_status(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::STATUS, v);
    }
    /// Sets the class-specific field.
    pub fn set_class_specific(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::CLASS_SPECIFIC, v);
    }
    /// Sets the transaction ID.
    pub fn set_transaction_id(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::TRANSACTION_ID, v);
    }
    /// Sets the attribute ID.
    pub fn set_attribute_id(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::ATTRIBUTE_ID, v);
    }
    /// Sets the reserved field.
    pub fn set_reserved(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::RESERVED, v);
    }
    /// Sets the attribute modifier.
    pub fn set_attribute_modifier(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::ATTRIBUTE_MODIFIER, v);
    }
}

/// The fields of a MAD header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Management class.
    pub mgmt_class: u8,
    /// Class version.
    pub class_version: u8,
    /// Method with the response bit.
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class-specific field.
    pub class_specific: u16,
    /// Transaction ID.
    pub transaction_id: u64,
    /// Attribute ID.
    pub attribute_id: u16,
    /// Attribute modifier.
    pub attribute_modifier: u32,
}

impl Repr {
    /// Parses a MAD header; the base version must be 1. The reserved field is
    /// ignored, as reserved fields are on receipt.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        if h.base_version() != BASE_VERSION {
            return Err(Error::UnsupportedVersion {
                field: "MAD base version",
                value: h.base_version(),
            });
        }
        Ok(Repr {
            mgmt_class: h.mgmt_class(),
            class_version: h.class_version(),
            method: h.method(),
            status: h.status(),
            class_specific: h.class_specific(),
            transaction_id: h.transaction_id(),
            attribute_id: h.attribute_id(),
            attribute_modifier: h.attribute_modifier(),
        })
    }
    /// Bytes the header takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }
    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_base_version(BASE_VERSION);
        h.set_mgmt_class(self.mgmt_class);
        h.set_class_version(self.class_version);
        h.set_method(self.method);
        h.set_status(self.status);
        h.set_class_specific(self.class_specific);
        h.set_transaction_id(self.transaction_id);
        h.set_attribute_id(self.attribute_id);
        h.set_reserved(0);
        h.set_attribute_modifier(self.attribute_modifier);
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MAD ")?;
        match class_name(self.mgmt_class) {
            Some(n) => f.write_str(n)?,
            None => write!(f, "class {:#04x}", self.mgmt_class)?,
        }
        let attr = if self.mgmt_class == CLASS_CM {
            cm_attribute_name(self.attribute_id)
        } else {
            None
        };
        match attr {
            Some(a) => write!(f, " {a}")?,
            None => write!(f, " attr {:#06x}", self.attribute_id)?,
        }
        match method_name(self.method) {
            Some(m) => write!(f, " {m}")?,
            None => write!(f, " method {:#04x}", self.method)?,
        }
        write!(f, " tid={:#x}", self.transaction_id)?;
        if self.status != 0 {
            write!(f, " status={:#06x}", self.status)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // rxe_rping.pcap frame 3: CM REQ.
    const REQ: [u8; 24] = [
        0x01, 0x07, 0x02, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x74, 0xb8, 0x8d,
        0x6c, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];

    #[test]
    fn golden_req() {
        let h = Header::new_checked(&REQ[..]).unwrap();
        let r = Repr::parse(&h).unwrap();
        assert_eq!(r.mgmt_class, CLASS_CM);
        assert_eq!(r.class_version, 2);
        assert_eq!(r.method, 3);
        assert_eq!(r.transaction_id, 0x2_74b8_8d6c);
        assert_eq!(r.attribute_id, 0x10);
        assert_eq!(r.to_string(), "MAD CM REQ Send tid=0x274b88d6c");
        let mut buf = [0xffu8; 24];
        r.emit(&mut Header::new_unchecked(&mut buf[..]));
        assert_eq!(buf, REQ);
    }

    #[test]
    fn malformed() {
        assert!(Header::new_checked(&REQ[..23]).is_err());
        let mut bad = REQ;
        bad[0] = 2;
        assert!(matches!(
            Repr::parse(&Header::new_unchecked(&bad[..])),
            Err(Error::UnsupportedVersion { value: 2, .. })
        ));
        // Reserved bits set: still the same MAD.
        let mut odd = REQ;
        odd[19] = 1;
        assert_eq!(
            Repr::parse(&Header::new_unchecked(&odd[..])),
            Repr::parse(&Header::new_unchecked(&REQ[..]))
        );
    }

    proptest! {
        #[test]
        fn round_trip(class: u8, cv: u8, m: u8, st: u16, cs: u16, tid: u64, a: u16, am: u32) {
            let r = Repr { mgmt_class: class, class_version: cv, method: m, status: st,
                           class_specific: cs, transaction_id: tid, attribute_id: a,
                           attribute_modifier: am };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
