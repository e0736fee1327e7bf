//! safetensors in memory (docs/protocol.md §5): an 8-byte little-endian length N, N bytes
//! of JSON header (name -> dtype, shape, data_offsets; optional `__metadata__`), then the
//! tensors' bytes, offsets counted from 8 + N.  Tensors may come in any order.

use super::json::{self, Json};

#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The safetensors code: F64, F32, F16, BF16, BOOL, ...
    pub code: String,
    pub shape: Vec<usize>,
    /// Byte range in the payload (absolute, not relative to the data section).
    pub start: usize,
    pub end: usize,
}

pub fn item_size(code: &str) -> Option<usize> {
    Some(match code {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F8_E4M3" | "F8_E5M2" | "BOOL" | "I8" | "U8" => 1,
        _ => return None,
    })
}

/// Every tensor of `payload` (checked: known dtype, offsets inside the data, matching sizes).
pub fn index(payload: &[u8]) -> Result<Vec<(String, TensorInfo)>, String> {
    if payload.is_empty() {
        return Ok(Vec::new());
    }
    if payload.len() < 8 {
        return Err("payload shorter than a safetensors header".into());
    }
    let n = u64::from_le_bytes(payload[..8].try_into().unwrap());
    if n > (payload.len() - 8) as u64 {
        return Err(format!("safetensors header length {n} beyond the payload ({} bytes)", payload.len()));
    }
    let base = 8 + n as usize;
    let header = json::parse(&payload[8..base]).map_err(|e| format!("safetensors header: {e}"))?;
    let items = header.as_object().ok_or("safetensors header is not a JSON object")?;
    let data_len = payload.len() - base;
    let mut out = Vec::new();
    for (name, entry) in items {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: &str| format!("safetensors tensor '{name}': {what}");
        let code = entry.get("dtype").and_then(Json::as_str).ok_or_else(|| bad("no dtype"))?;
        let size = item_size(code).ok_or_else(|| bad(&format!("unknown dtype '{code}'")))?;
        let shape: Vec<usize> = entry
            .get("shape")
            .and_then(Json::as_array)
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of integers"))?;
        let offsets = entry.get("data_offsets").and_then(Json::as_array).ok_or_else(|| bad("no data_offsets"))?;
        let (start, end) = match offsets {
            [a, b] => (a.as_u64().ok_or_else(|| bad("bad data_offsets"))?, b.as_u64().ok_or_else(|| bad("bad data_offsets"))?),
            _ => return Err(bad("data_offsets is not [start, end]")),
        };
        let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("shape too large"))?;
        if start > end || end > data_len as u64 || (end - start) as u128 != count as u128 * size as u128 {
            return Err(bad(&format!("data_offsets [{start}, {end}] do not fit shape {shape:?} of {code} in {data_len} data bytes")));
        }
        out.push((
            name.clone(),
            TensorInfo { code: code.to_string(), shape, start: base + start as usize, end: base + end as usize },
        ));
    }
    Ok(out)
}

/// The first 8 + N bytes of a safetensors payload holding `tensors` (name, code, shape,
/// item size) back to back in this order, the header padded with spaces to a multiple of
/// 8 bytes; and the payload's total length.  The caller writes the data after it.
pub fn encode_header(tensors: &[(&str, &str, &[usize], usize)]) -> (Vec<u8>, u64) {
    let mut offset = 0u64;
    let mut items = Vec::new();
    for (name, code, shape, size) in tensors {
        let nbytes = shape.iter().product::<usize>() as u64 * *size as u64;
        items.push((
            name.to_string(),
            Json::obj(vec![
                ("dtype", Json::str(code)),
                ("shape", Json::Arr(shape.iter().map(|&d| Json::int(d as u64)).collect())),
                ("data_offsets", Json::Arr(vec![Json::int(offset), Json::int(offset + nbytes)])),
            ]),
        ));
        offset += nbytes;
    }
    let mut text = Json::Obj(items).to_text().into_bytes();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    let total = out.len() as u64 + offset;
    (out, total)
}
