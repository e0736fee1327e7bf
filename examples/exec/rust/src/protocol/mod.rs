//! mhaspec-wire/1 (docs/protocol.md): frames, JSON, safetensors, the case, the replies.
//! Nothing here knows how attention is computed; `crate::attention` is called with a
//! `Case` and gives back `Stage`s.

pub mod case;
pub mod frame;
pub mod json;
pub mod safetensors;

use std::io::{self, Write};

use crate::dtypes::{self, Dtype};
use json::Json;

pub const PROTOCOL: &str = "mhaspec-wire/1";

/// A stage's values, C order.  They go on the wire in the case's dtype: values that are
/// already of that dtype (f32 holding float16 or bfloat16 values, say) travel exactly;
/// others are rounded to it.
pub enum Values {
    F64(Vec<f64>),
    F32(Vec<f32>),
}

impl Values {
    fn len(&self) -> usize {
        match self {
            Values::F64(v) => v.len(),
            Values::F32(v) => v.len(),
        }
    }
}

pub struct Stage {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub values: Values,
}

/// The `ready` message (#/$defs/ready).
pub fn ready(name: &str, environment: Json) -> Json {
    Json::obj(vec![
        ("reply", Json::str("ready")),
        ("protocol", Json::str(PROTOCOL)),
        ("ok", Json::Bool(true)),
        ("name", Json::str(name)),
        ("dtypes", Json::Arr(["float64", "float32", "float16", "bfloat16"].iter().map(|d| Json::str(d)).collect())),
        ("deviations", Json::Arr(vec![])),
        ("framework", Json::Null),
        ("framework_version", Json::Null),
        ("has_supports", Json::Bool(false)),
        ("has_backward", Json::Bool(false)),
        ("environment", environment),
    ])
}

/// The number (`seq`) of the request being answered, echoed in every reply so that the runner can
/// tell a reply to another request apart; `u64::MAX`: the request had none.
static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Remembers the `seq` of the request about to be answered (none: `None`).
pub fn answering(seq: Option<u64>) {
    SEQ.store(seq.unwrap_or(u64::MAX), std::sync::atomic::Ordering::Relaxed);
}

fn numbered(mut items: Vec<(&str, Json)>) -> Json {
    let seq = SEQ.load(std::sync::atomic::Ordering::Relaxed);
    if seq != u64::MAX {
        items.push(("seq", Json::int(seq)));
    }
    Json::obj(items)
}

/// A failed step (#/$defs/failure): one line naming the cause.
pub fn failure(step: &str, error: &str) -> Json {
    let line = error.replace(['\n', '\r'], " ");
    numbered(vec![("reply", Json::str(step)), ("ok", Json::Bool(false)), ("error", Json::Str(line))])
}

/// Writes the reply to a `run` (#/$defs/returned): the header, then the stages as a
/// safetensors payload in `dtype`, converted and written in chunks.  A stage whose number
/// of values does not match its shape is a failure reply instead.
pub fn write_run_reply<W: Write>(w: &mut W, stages: &[Stage], dtype: Dtype, seconds: f64) -> io::Result<()> {
    for s in stages {
        if s.values.len() != s.shape.iter().product::<usize>() {
            let msg = format!("stage {} has {} values for shape {:?}", s.name, s.values.len(), s.shape);
            return frame::write_header_only(w, &failure("run", &msg));
        }
    }
    let header = numbered(vec![
        ("reply", Json::str("run")),
        ("ok", Json::Bool(true)),
        ("seconds", Json::num(seconds.max(0.0))),
        ("mapping", Json::Bool(true)),
        ("keys", Json::Arr(stages.iter().map(|s| Json::str(s.name)).collect())),
        ("special", Json::Obj(vec![])),
    ]);
    let entries: Vec<(&str, &str, &[usize], usize)> =
        stages.iter().map(|s| (s.name, dtype.code(), s.shape.as_slice(), dtype.item_size())).collect();
    let (st_header, total) = safetensors::encode_header(&entries);
    frame::write_frame_with(w, &header, total, |w| {
        w.write_all(&st_header)?;
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        for s in stages {
            match &s.values {
                Values::F64(v) => write_values(w, &mut buf, v, |x, out| encode(x, dtype, out))?,
                Values::F32(v) => write_values(w, &mut buf, v, |x, out| encode_f32(x, dtype, out))?,
            }
        }
        Ok(())
    })
}

fn write_values<W: Write, T: Copy>(
    w: &mut W,
    buf: &mut Vec<u8>,
    values: &[T],
    enc: impl Fn(T, &mut Vec<u8>),
) -> io::Result<()> {
    for chunk in values.chunks(8192) {
        buf.clear();
        for &x in chunk {
            enc(x, buf);
        }
        w.write_all(buf)?;
    }
    Ok(())
}

/// An f64 in `dtype`, little-endian, rounded to nearest even.
fn encode(x: f64, dtype: Dtype, out: &mut Vec<u8>) {
    match dtype {
        Dtype::F64 => out.extend_from_slice(&x.to_le_bytes()),
        Dtype::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
        Dtype::F16 => out.extend_from_slice(&dtypes::f16_bits(x).to_le_bytes()),
        Dtype::BF16 => out.extend_from_slice(&dtypes::bf16_bits(x).to_le_bytes()),
    }
}

/// An f32 in `dtype`, little-endian, rounded to nearest even.
fn encode_f32(x: f32, dtype: Dtype, out: &mut Vec<u8>) {
    match dtype {
        Dtype::F64 => out.extend_from_slice(&(x as f64).to_le_bytes()),
        Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        Dtype::F16 => out.extend_from_slice(&dtypes::f16_bits(x as f64).to_le_bytes()),
        Dtype::BF16 => out.extend_from_slice(&dtypes::bf16_bits_f32(x).to_le_bytes()),
    }
}
