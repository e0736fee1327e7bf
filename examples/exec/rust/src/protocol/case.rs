//! A case request's `case` object and payload (docs/protocol.md §4-5), checked, as the
//! attention code sees it: sizes, config, and read-only views of its float64 arrays.

use super::json::Json;
use super::safetensors::{self, TensorInfo};
use crate::dtypes::Dtype;

/// The layer, every size resolved (docs/spec.md §2).
#[derive(Debug, Clone)]
pub struct Config {
    pub d_model: usize,
    /// H
    pub num_heads: usize,
    pub kdim: usize,
    pub vdim: usize,
    /// H_kv; H % H_kv == 0, query head h reads key/value head h / (H / H_kv)
    pub num_kv_heads: usize,
    /// D_k
    pub head_dim: usize,
    /// D_v
    pub value_head_dim: usize,
    pub out_dim: usize,
    pub bias: bool,
    pub scale: f64,
    pub causal: bool,
    /// causal_alignment "bottom_right" (else "top_left")
    pub bottom_right: bool,
}

/// The config fields this worker computes; any other must be off (null, false or 0).
const KNOWN_CONFIG: [&str; 12] = [
    "d_model", "num_heads", "kdim", "vdim", "num_kv_heads", "head_dim", "value_head_dim", "out_dim", "bias",
    "scale", "causal", "causal_alignment",
];

pub struct Case {
    pub dtype: Dtype,
    /// B, T, S
    pub batch: usize,
    pub tgt_len: usize,
    pub src_len: usize,
    pub config: Config,
    payload: Vec<u8>,
    tensors: Vec<(String, TensorInfo)>,
    /// input name -> the input whose array it is (self-attention, shared key/value)
    aliases: Vec<(String, String)>,
}

/// A float64 array in the payload, C order.
pub struct F64Array<'a> {
    pub shape: &'a [usize],
    bytes: &'a [u8],
}

impl F64Array<'_> {
    pub fn len(&self) -> usize {
        self.bytes.len() / 8
    }

    #[inline]
    pub fn get(&self, i: usize) -> f64 {
        f64::from_le_bytes(self.bytes[8 * i..8 * i + 8].try_into().unwrap())
    }
}

/// The boolean mask (true = may attend), 4-d, each dimension 1 or (B, H, T, S)'s.
pub struct BoolArray<'a> {
    pub shape: &'a [usize],
    bytes: &'a [u8],
}

impl BoolArray<'_> {
    /// The element strides for indexing with (b, h, i, j) over (B, H, T, S): 0 where broadcast.
    pub fn broadcast_strides(&self) -> [usize; 4] {
        let mut strides = [0usize; 4];
        let mut step = 1;
        for d in (0..4).rev() {
            strides[d] = if self.shape[d] == 1 { 0 } else { step };
            step *= self.shape[d];
        }
        strides
    }

    #[inline]
    pub fn get(&self, i: usize) -> bool {
        self.bytes[i] != 0
    }
}

fn field<'a>(obj: &'a Json, key: &str, what: &str) -> Result<&'a Json, String> {
    obj.get(key).ok_or_else(|| format!("{what} has no '{key}'"))
}

fn size(obj: &Json, key: &str, what: &str) -> Result<usize, String> {
    match field(obj, key, what)?.as_u64() {
        Some(v) if (1..=1 << 40).contains(&v) => Ok(v as usize),
        _ => Err(format!("{what}.{key} is not a positive integer")),
    }
}

fn flag(obj: &Json, key: &str, what: &str) -> Result<bool, String> {
    field(obj, key, what)?.as_bool().ok_or_else(|| format!("{what}.{key} is not true or false"))
}

impl Case {
    /// The case of a request: its `case` object and payload, every array checked against the sizes.
    pub fn from_request(case: &Json, payload: Vec<u8>) -> Result<Case, String> {
        let scalars = field(case, "scalars", "case")?;
        let config = field(case, "config", "case")?;
        if config.as_object().is_none() {
            return Err("case.config is not an object".into());
        }
        let dtype_name = field(scalars, "dtype", "case.scalars")?.as_str().unwrap_or("?");
        let dtype = Dtype::from_name(dtype_name).ok_or_else(|| format!("unknown dtype '{dtype_name}'"))?;
        let (batch, tgt_len, src_len) = (
            size(scalars, "batch", "case.scalars")?,
            size(scalars, "tgt_len", "case.scalars")?,
            size(scalars, "src_len", "case.scalars")?,
        );

        for (key, value) in config.as_object().unwrap() {
            if !KNOWN_CONFIG.contains(&key.as_str()) && !value.is_default_off() {
                return Err(format!(
                    "config field '{key}' = {} is not known to this worker (it computes only {})",
                    value.to_text(),
                    KNOWN_CONFIG.join(", ")
                ));
            }
        }
        let what = "case.config";
        let alignment = field(config, "causal_alignment", what)?.as_str().unwrap_or("?");
        let bottom_right = match alignment {
            "top_left" => false,
            "bottom_right" => true,
            other => return Err(format!("unknown causal_alignment '{other}'")),
        };
        let scale = field(config, "scale", what)?.as_f64().filter(|s| s.is_finite() && *s > 0.0);
        let config = Config {
            d_model: size(config, "d_model", what)?,
            num_heads: size(config, "num_heads", what)?,
            kdim: size(config, "kdim", what)?,
            vdim: size(config, "vdim", what)?,
            num_kv_heads: size(config, "num_kv_heads", what)?,
            head_dim: size(config, "head_dim", what)?,
            value_head_dim: size(config, "value_head_dim", what)?,
            out_dim: size(config, "out_dim", what)?,
            bias: flag(config, "bias", what)?,
            scale: scale.ok_or("case.config.scale is not a positive number")?,
            causal: flag(config, "causal", what)?,
            bottom_right,
        };
        if config.num_heads % config.num_kv_heads != 0 {
            return Err(format!("num_heads {} is not a multiple of num_kv_heads {}", config.num_heads, config.num_kv_heads));
        }

        let mut aliases = Vec::new();
        if let Some(a) = case.get("aliases") {
            for (name, same) in a.as_object().ok_or("case.aliases is not an object")? {
                let same = same.as_str().ok_or("case.aliases maps to a non-string")?;
                aliases.push((name.clone(), same.to_string()));
            }
        }
        let tensors = safetensors::index(&payload)?;
        let c = Case { dtype, batch, tgt_len, src_len, config, payload, tensors, aliases };
        c.check_arrays()?;
        Ok(c)
    }

    /// Every array the computation reads is there, float64 (the mask BOOL), of its shape.
    fn check_arrays(&self) -> Result<(), String> {
        let c = &self.config;
        let (b, t, s) = (self.batch, self.tgt_len, self.src_len);
        let (h, g, dk, dv) = (c.num_heads, c.num_kv_heads, c.head_dim, c.value_head_dim);
        let mut want: Vec<(String, Vec<usize>)> = vec![
            (self.resolve("query"), vec![b, t, c.d_model]),
            (self.resolve("key"), vec![b, s, c.kdim]),
            (self.resolve("value"), vec![b, s, c.vdim]),
            ("weight.w_q".into(), vec![c.d_model, h * dk]),
            ("weight.w_k".into(), vec![c.kdim, g * dk]),
            ("weight.w_v".into(), vec![c.vdim, g * dv]),
            ("weight.w_o".into(), vec![h * dv, c.out_dim]),
        ];
        if c.bias {
            want.push(("weight.b_q".into(), vec![h * dk]));
            want.push(("weight.b_k".into(), vec![g * dk]));
            want.push(("weight.b_v".into(), vec![g * dv]));
            want.push(("weight.b_o".into(), vec![c.out_dim]));
        }
        for (name, shape) in &want {
            let info = self.tensor(name).ok_or_else(|| format!("the payload has no array '{name}'"))?;
            if info.code != "F64" {
                return Err(format!("array '{name}' is {}, not F64", info.code));
            }
            if &info.shape != shape {
                return Err(format!("array '{name}' has shape {:?}, expected {:?}", info.shape, shape));
            }
        }
        if let Some(info) = self.tensor(&self.resolve("mask")) {
            if info.code != "BOOL" {
                return Err(format!("the mask is {}, not BOOL", info.code));
            }
            let full = [b, h, t, s];
            let ok = info.shape.len() == 4 && info.shape.iter().zip(full).all(|(&d, f)| d == 1 || d == f);
            if !ok {
                return Err(format!("the mask's shape {:?} does not broadcast to (B, H, T, S) = {:?}", info.shape, full));
            }
        }
        Ok(())
    }

    /// The payload name of input `name`, following aliases.
    fn resolve(&self, name: &str) -> String {
        let mut name = name.to_string();
        for _ in 0..4 {
            match self.aliases.iter().find(|(k, _)| *k == name) {
                Some((_, same)) => name = same.clone(),
                None => break,
            }
        }
        format!("input.{name}")
    }

    fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().rev().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    fn f64_array(&self, name: &str) -> F64Array<'_> {
        let t = self.tensor(name).expect("checked by check_arrays");
        F64Array { shape: &t.shape, bytes: &self.payload[t.start..t.end] }
    }

    /// `query` (B, T, d_model), `key` (B, S, kdim) or `value` (B, S, vdim).
    pub fn input(&self, name: &str) -> F64Array<'_> {
        self.f64_array(&self.resolve(name))
    }

    /// `w_q`, `w_k`, `w_v`, `w_o` (in, out): y = x · W + b.
    pub fn weight(&self, name: &str) -> F64Array<'_> {
        self.f64_array(&format!("weight.{name}"))
    }

    /// `b_q`, `b_k`, `b_v`, `b_o`; None when config.bias is false.
    pub fn bias(&self, name: &str) -> Option<F64Array<'_>> {
        if self.config.bias {
            Some(self.f64_array(&format!("weight.{name}")))
        } else {
            None
        }
    }

    /// The mask, if the case has one.
    pub fn mask(&self) -> Option<BoolArray<'_>> {
        let t = self.tensor(&self.resolve("mask"))?;
        Some(BoolArray { shape: &t.shape, bytes: &self.payload[t.start..t.end] })
    }
}
