//! Frames (docs/protocol.md §2): a 16-byte prefix, H then P as unsigned 64-bit little-endian,
//! then H bytes of JSON header, then P bytes of safetensors payload.

use std::io::{self, Read, Write};

use super::json::{self, Json};

/// The largest header and payload a frame may carry.
pub const MAX_HEADER: u64 = 1 << 24;
pub const MAX_PAYLOAD: u64 = 1 << 40;

pub struct Frame {
    pub header: Json,
    pub payload: Vec<u8>,
}

/// Reads as many bytes as fill `buf`; Ok(false) at end of file before the first byte.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<bool, String> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(format!("end of file after {got} of {} bytes of a frame", buf.len())),
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the request stream: {e}")),
        }
    }
    Ok(true)
}

/// The next frame; None at end of file between frames (the runner has gone: exit quietly).
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, String> {
    let mut head = [0u8; 16];
    if !read_full(r, &mut head)? {
        return Ok(None);
    }
    let h = u64::from_le_bytes(head[..8].try_into().unwrap());
    let p = u64::from_le_bytes(head[8..].try_into().unwrap());
    if h > MAX_HEADER || p > MAX_PAYLOAD {
        return Err(format!("not a frame: header length {h}, payload length {p}"));
    }
    let mut text = vec![0u8; h as usize];
    let mut payload = vec![0u8; p as usize];
    if !read_full(r, &mut text)? && h > 0 {
        return Err("end of file inside a frame".into());
    }
    if !read_full(r, &mut payload)? && p > 0 {
        return Err("end of file inside a frame".into());
    }
    let header = json::parse(&text).map_err(|e| format!("a request header that is not JSON: {e}"))?;
    if header.as_object().is_none() {
        return Err("a request header that is not a JSON object".into());
    }
    Ok(Some(Frame { header, payload }))
}

/// Writes one frame whose payload, `payload_len` bytes, is produced by `write_payload`
/// (so a large reply is streamed, never built in memory twice), then flushes.
pub fn write_frame_with<W: Write>(
    w: &mut W,
    header: &Json,
    payload_len: u64,
    write_payload: impl FnOnce(&mut W) -> io::Result<()>,
) -> io::Result<()> {
    let text = header.to_text();
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(&payload_len.to_le_bytes())?;
    w.write_all(text.as_bytes())?;
    write_payload(w)?;
    w.flush()
}

/// A frame with no payload.
pub fn write_header_only<W: Write>(w: &mut W, header: &Json) -> io::Result<()> {
    write_frame_with(w, header, 0, |_| Ok(()))
}
