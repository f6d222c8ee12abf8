//! A tiny, allocation-free MessagePack reader over a byte slice.
//!
//! It reads one value header at a time, so decoders can walk a map, pick the
//! keys they know and skip the rest without building a tree. Nothing here
//! trusts a length prefix: every read is checked against the bytes actually
//! present, so no input can make it allocate or loop beyond its own size
//! (`small_uints_into` grows only the caller's buffer, by at most one id
//! per byte left).

use rmp::Marker;

/// One MessagePack value, read shallowly: containers give their length only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    /// Any integer, signed or unsigned, widened.
    Int(i128),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Value<'_> {
    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Nil => "nil",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::Str(_) => "a string",
            Value::Bin(_) => "binary",
            Value::Array(_) => "an array",
            Value::Map(_) => "a map",
            Value::Ext => "an extension value",
        }
    }
}

/// The input ended early or held something that is not MessagePack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("message is truncated")]
    Truncated,
    #[error("message uses a reserved MessagePack marker")]
    Reserved,
    #[error("a string is not valid UTF-8")]
    Utf8,
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// How many bytes have been consumed.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The next value if it is an unsigned integer below 2^32 in any width
    /// (the common case of token ids, read without building a [`Value`]);
    /// `None`, consuming nothing, for anything else.
    pub fn small_uint(&mut self) -> Option<u32> {
        let rest = &self.buf[self.pos..];
        let (v, len) = match *rest.first()? {
            b @ 0x00..=0x7f => (u32::from(b), 1),
            0xcc => (u32::from(*rest.get(1)?), 2),
            0xcd => (u32::from(u16::from_be_bytes([*rest.get(1)?, *rest.get(2)?])), 3),
            0xce => (u32::from_be_bytes(rest.get(1..5)?.try_into().ok()?), 5),
            _ => return None,
        };
        self.pos += len;
        Some(v)
    }

    /// Reads up to `n` unsigned integers below 2^32 in the widths an
    /// encoder picks for them (a positive fixint, `uint8`, `uint16`,
    /// `uint32`), passing each to `each`; how many it read. It stops early,
    /// consuming nothing more, at anything else and when fewer than five
    /// bytes are left, so [`Reader::small_uint`] can take over there.
    ///
    /// Token ids mix widths at random (below and above 65,536), so deciding
    /// the width with a `match` mispredicts about every other element; here
    /// the width is arithmetic on the marker and the value a shift of the
    /// four bytes after it, selected without a branch. (Reading three
    /// elements from one 16-byte load was tried: no faster, 2.9 ns an id
    /// either way on the bench machine.)
    pub fn small_uints(&mut self, n: u32, mut each: impl FnMut(u32)) -> u32 {
        let mut read = 0;
        while read < n {
            let Some(&[marker, b1, b2, b3, b4]) = self.buf.get(self.pos..self.pos + 5) else { break };
            let fix = marker < 0x80;
            // 0xcc, 0xcd, 0xce: 1, 2 or 4 bytes follow.
            let wide = marker.wrapping_sub(0xcc);
            if !fix && wide > 2 {
                break;
            }
            let bytes = if fix { 0 } else { 1u32 << wide };
            let tail = u32::from_be_bytes([b1, b2, b3, b4]) >> ((32 - 8 * bytes) & 31);
            each(if fix { u32::from(marker) } else { tail });
            self.pos += 1 + bytes as usize;
            read += 1;
        }
        read
    }

    /// [`Reader::small_uints`] appending to `out`: written in place rather
    /// than pushed, so the loop keeps the length in a register. Reserves no
    /// more than the bytes left could hold.
    pub fn small_uints_into(&mut self, n: u32, out: &mut Vec<u32>) -> u32 {
        let start = out.len();
        out.resize(start + self.room_for(n), 0);
        let (slots, mut i) = (&mut out[start..], 0);
        let read = self.small_uints(n, |t| {
            slots[i] = t;
            i += 1;
        });
        out.truncate(start + read as usize);
        read
    }

    /// The next value if it is an unsigned integer in any width (read
    /// without building a [`Value`]); `None`, consuming nothing, otherwise.
    pub fn uint64(&mut self) -> Option<u64> {
        if let Some(v) = self.small_uint() {
            return Some(v.into());
        }
        let rest = &self.buf[self.pos..];
        match *rest.first()? {
            0xcf => {
                let v = u64::from_be_bytes(rest.get(1..9)?.try_into().ok()?);
                self.pos += 9;
                Some(v)
            }
            _ => None,
        }
    }

    /// `n` items, or fewer when fewer bytes are left (each item takes at
    /// least one): a capacity to reserve that no length prefix can inflate.
    pub fn room_for(&self, n: u32) -> usize {
        (n as usize).min(self.buf.len() - self.pos)
    }

    /// True when every byte has been consumed.
    pub fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self.pos.checked_add(n).ok_or(ReadError::Truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or(ReadError::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, ReadError> {
        Ok(self.be::<1>()?[0] as usize)
    }
    fn len16(&mut self) -> Result<usize, ReadError> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    fn len32(&mut self) -> Result<u32, ReadError> {
        Ok(u32::from_be_bytes(self.be()?))
    }

    fn str_of(&mut self, len: usize) -> Result<Value<'a>, ReadError> {
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map(Value::Str).map_err(|_| ReadError::Utf8)
    }

    /// Reads the next value's header (and its payload, for scalars).
    pub fn read(&mut self) -> Result<Value<'a>, ReadError> {
        let marker = Marker::from_u8(self.be::<1>()?[0]);
        Ok(match marker {
            Marker::Null => Value::Nil,
            Marker::True => Value::Bool(true),
            Marker::False => Value::Bool(false),
            Marker::FixPos(v) => Value::Int(v.into()),
            Marker::FixNeg(v) => Value::Int(v.into()),
            Marker::U8 => Value::Int(self.be::<1>()?[0].into()),
            Marker::U16 => Value::Int(u16::from_be_bytes(self.be()?).into()),
            Marker::U32 => Value::Int(u32::from_be_bytes(self.be()?).into()),
            Marker::U64 => Value::Int(u64::from_be_bytes(self.be()?).into()),
            Marker::I8 => Value::Int(i8::from_be_bytes(self.be()?).into()),
            Marker::I16 => Value::Int(i16::from_be_bytes(self.be()?).into()),
            Marker::I32 => Value::Int(i32::from_be_bytes(self.be()?).into()),
            Marker::I64 => Value::Int(i64::from_be_bytes(self.be()?).into()),
            Marker::F32 => Value::Float(f32::from_be_bytes(self.be()?).into()),
            Marker::F64 => Value::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => self.str_of(n as usize)?,
            Marker::Str8 => {
                let n = self.len8()?;
                self.str_of(n)?
            }
            Marker::Str16 => {
                let n = self.len16()?;
                self.str_of(n)?
            }
            Marker::Str32 => {
                let n = self.len32()? as usize;
                self.str_of(n)?
            }
            Marker::Bin8 => {
                let n = self.len8()?;
                Value::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = self.len16()?;
                Value::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.len32()? as usize;
                Value::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Value::Array(n.into()),
            Marker::Array16 => Value::Array(self.len16()? as u32),
            Marker::Array32 => Value::Array(self.len32()?),
            Marker::FixMap(n) => Value::Map(n.into()),
            Marker::Map16 => Value::Map(self.len16()? as u32),
            Marker::Map32 => Value::Map(self.len32()?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.len8()?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len16()?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len32()? as usize;
                self.ext(n)?
            }
            Marker::Reserved => return Err(ReadError::Reserved),
        })
    }

    fn ext(&mut self, len: usize) -> Result<Value<'a>, ReadError> {
        self.take(1 + len)?; // type byte + payload
        Ok(Value::Ext)
    }

    /// Skips whatever is left of a value whose header `first` was just read
    /// (the contents of an array or map; nothing for a scalar). Iterative, so
    /// deep nesting cannot overflow the stack; each step consumes input, so
    /// it ends within the message's length.
    pub fn skip_rest(&mut self, first: Value<'a>) -> Result<(), ReadError> {
        let mut remaining: u64 = children(first);
        while remaining > 0 {
            remaining -= 1;
            // Integers (token ids, keys) are skipped by their length alone.
            match self.buf.get(self.pos).and_then(|&b| int_len(b)) {
                Some(n) => drop(self.take(n)?),
                None => remaining += children(self.read()?),
            }
        }
        Ok(())
    }
}

/// The encoded length of an integer whose marker is `b`; `None` for any other marker.
fn int_len(b: u8) -> Option<usize> {
    match b {
        0x00..=0x7f | 0xe0..=0xff => Some(1),
        0xcc | 0xd0 => Some(2),
        0xcd | 0xd1 => Some(3),
        0xce | 0xd2 => Some(5),
        0xcf | 0xd3 => Some(9),
        _ => None,
    }
}

fn children(v: Value<'_>) -> u64 {
    match v {
        Value::Array(n) => u64::from(n),
        Value::Map(n) => 2 * u64::from(n),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc<T: serde::Serialize>(v: &T) -> Vec<u8> {
        rmp_serde::to_vec_named(v).unwrap()
    }

    #[test]
    fn reads_scalars_of_every_width() {
        for n in [0i128, 1, 127, 128, 255, 256, 65535, 65536, u32::MAX as i128 + 1] {
            let b = enc(&(n as u64));
            assert_eq!(Reader::new(&b).read(), Ok(Value::Int(n)));
        }
        for n in [-1i128, -32, -33, -129, -32769, i64::MIN as i128] {
            let b = enc(&(n as i64));
            assert_eq!(Reader::new(&b).read(), Ok(Value::Int(n)));
        }
        assert_eq!(Reader::new(&enc(&1.5f64)).read(), Ok(Value::Float(1.5)));
        assert_eq!(Reader::new(&enc(&2.5f32)).read(), Ok(Value::Float(2.5)));
        assert_eq!(Reader::new(&enc(&"hé")).read(), Ok(Value::Str("hé")));
        assert_eq!(Reader::new(&[0xc0]).read(), Ok(Value::Nil));
        assert_eq!(Reader::new(&[0xc3]).read(), Ok(Value::Bool(true)));
    }

    #[test]
    fn small_uints_in_every_width_and_nothing_else() {
        for n in [0u64, 127, 128, 255, 256, 65_535, 65_536, u64::from(u32::MAX)] {
            let b = enc(&n);
            let mut r = Reader::new(&b);
            assert_eq!(r.small_uint(), Some(n as u32), "{n}");
            assert!(r.at_end());
        }
        for b in [enc(&(u64::from(u32::MAX) + 1)), enc(&-1i64), enc(&"7"), vec![0xcd, 0x01]] {
            let mut r = Reader::new(&b);
            assert_eq!(r.small_uint(), None, "{b:?}");
            assert_eq!(r.position(), 0, "nothing consumed");
        }
        let mut r = Reader::new(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.uint64(), Some(u64::MAX));
        assert_eq!(Reader::new(&[0xcf, 0xff]).uint64(), None, "truncated");
        assert_eq!(Reader::new(&enc(&-5i64)).uint64(), None);
    }

    #[test]
    fn small_uints_in_bulk_read_what_small_uint_reads_and_stop_where_it_would() {
        let widths = [0u64, 127, 128, 255, 256, 65_535, 65_536, u64::from(u32::MAX), 5, 70_000];
        let mut b: Vec<u8> = widths.iter().flat_map(enc).collect();
        // Then a value it leaves alone, and one more it would read.
        b.extend(enc(&(u64::from(u32::MAX) + 1)));
        b.extend(enc(&7u64));
        let mut r = Reader::new(&b);
        let mut got = Vec::new();
        assert_eq!(r.small_uints(100, |t| got.push(u64::from(t))), widths.len() as u32);
        assert_eq!(got, widths);
        assert_eq!(r.uint64(), Some(u64::from(u32::MAX) + 1), "it stopped before the wide value");
        // Fewer than five bytes left: nothing read, for small_uint to take.
        assert_eq!(r.small_uints(100, |_| panic!("none")), 0);
        assert_eq!(r.small_uint(), Some(7));
        // At most `n`.
        let mut r = Reader::new(&b);
        assert_eq!(r.small_uints(3, |_| ()), 3);
        assert_eq!(r.small_uint(), Some(255));
        let mut into = vec![9];
        assert_eq!(Reader::new(&b).small_uints_into(100, &mut into), widths.len() as u32);
        assert_eq!(into[0], 9, "appended");
        assert_eq!(into[1..].iter().map(|&t| u64::from(t)).collect::<Vec<_>>(), widths);
        for other in [enc(&-1i64), enc(&"seven"), enc(&1.5f64), vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 1]] {
            let mut r = Reader::new(&other);
            assert_eq!((r.small_uints(1, |_| ()), r.position()), (0, 0), "{other:?}");
        }
    }

    proptest::proptest! {
        /// Reading in bulk reads what one at a time reads, and stops at
        /// the same element, at every length.
        #[test]
        fn small_uints_read_what_small_uint_reads(
            ids in proptest::collection::vec(proptest::prop_oneof![0u64..128, 128u64..65_536, 65_536u64..1 << 32], 0..40),
            stop_at in proptest::option::of(0usize..40),
            n in 0u32..48,
        ) {
            let mut b: Vec<u8> = Vec::new();
            for (i, id) in ids.iter().enumerate() {
                if stop_at == Some(i) {
                    b.extend(enc(&-1i64));
                }
                b.extend(enc(id));
            }
            let mut one = Reader::new(&b);
            let mut want = Vec::new();
            while (want.len() as u32) < n {
                match one.small_uint() {
                    Some(t) => want.push(t),
                    None => break,
                }
            }
            let mut bulk = Reader::new(&b);
            let mut got = Vec::new();
            let read = bulk.small_uints(n, |t| got.push(t));
            // Bulk reading leaves the last elements (under five bytes) to small_uint.
            while (got.len() as u32) < n {
                match bulk.small_uint() {
                    Some(t) => got.push(t),
                    None => break,
                }
            }
            proptest::prop_assert!(read as usize <= got.len());
            proptest::prop_assert_eq!(&got, &want);
            proptest::prop_assert_eq!(bulk.position(), one.position());
        }
    }

    #[test]
    fn skips_nested_containers() {
        let b = enc(&(vec![vec![1u8, 2], vec![3]], "tail"));
        let mut r = Reader::new(&b);
        let outer = r.read().unwrap();
        assert_eq!(outer, Value::Array(2));
        let first = r.read().unwrap();
        r.skip_rest(first).unwrap();
        assert_eq!(r.read(), Ok(Value::Str("tail")));
        assert!(r.at_end());
    }

    #[test]
    fn integers_are_skipped_by_length_and_truncation_is_still_caught() {
        let b = enc(&(vec![1u64, 300, 70_000, u64::MAX], vec![-1i64, -200, i64::MIN], "tail"));
        let mut r = Reader::new(&b);
        let outer = r.read().unwrap();
        r.skip_rest(outer).unwrap();
        assert!(r.at_end());
        let mut cut = enc(&vec![u64::MAX]);
        cut.pop();
        let mut r = Reader::new(&cut);
        let v = r.read().unwrap();
        assert_eq!(r.skip_rest(v), Err(ReadError::Truncated));
    }

    #[test]
    fn lying_lengths_are_truncation_not_allocation() {
        // array32 claiming 4 billion elements, then nothing.
        let b = [0xdd, 0xff, 0xff, 0xff, 0xff];
        let mut r = Reader::new(&b);
        let v = r.read().unwrap();
        assert_eq!(r.skip_rest(v), Err(ReadError::Truncated));
        // str32 claiming 4 GiB.
        assert_eq!(Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']).read(), Err(ReadError::Truncated));
        assert_eq!(Reader::new(&[0xc1]).read(), Err(ReadError::Reserved));
        assert_eq!(Reader::new(&[0xa2, 0xff, 0xfe]).read(), Err(ReadError::Utf8));
    }
}
