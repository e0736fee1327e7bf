//! The multi-head attention itself: every forward stage of docs/spec.md §2, with the
//! precision policy of mhaspec's numpy adapter (`mhaspec/adapters/numpy_mha.py`):
//!
//! - dt = the case's dtype; acc = f32 for float16 and bfloat16, else dt.  Every stage is
//!   stored in dt (`P::rnd`); every product sum is accumulated in acc.
//! - q = rnd(x · W_q + b_q) (row vectors, W is (in, out)); likewise k and v.
//! - scores[b,h,i,j] = rnd((q_h,i · k_g(h),j) · scale), for every (i, j), masked or not;
//!   g(h) = h / (H / H_kv).
//! - visible = the causal rule (j <= i + off; off = 0 top-left, S - T bottom-right) AND the
//!   mask.  Softmax over the visible j in acc (minus the row's max, exp, sum, divide),
//!   attn_weights = rnd(p), 0 where not visible; a row that sees no key is all 0.
//! - head_outputs = rnd(Σ_j p · v); concat = heads side by side; output = rnd(concat · W_o + b_o).
//!
//! This is the part to replace with a call into your own kernel: `forward` gets a checked
//! `Case` (sizes, config, float64 arrays) and returns the stages, in pipeline order.
//! Return every stage your kernel can expose (the first failing one is where a bug is);
//! leave out the ones it cannot (reported `not exposed`); `output` is required.

use std::ops::{Add, AddAssign, Div, Mul, Sub};

use crate::dtypes::{self, Dtype};
use crate::protocol::case::{BoolArray, Case, F64Array};
use crate::protocol::{Stage, Values};

/// A planted bug, for showing what a failing kernel looks like (`--bug NAME`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// The causal rule excludes the diagonal: j < i + off instead of j <= i + off.
    CausalDiagonal,
}

impl Bug {
    pub const NAMES: [&'static str; 1] = ["causal-diagonal"];

    pub fn from_name(name: &str) -> Option<Bug> {
        match name {
            "causal-diagonal" => Some(Bug::CausalDiagonal),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Bug::CausalDiagonal => "causal-diagonal",
        }
    }
}

/// The accumulator type: f64 or f32.
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + AddAssign
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn is_finite(self) -> bool;
    fn values(v: Vec<Self>) -> Values;
}

impl Real for f64 {
    const ZERO: f64 = 0.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
    fn values(v: Vec<f64>) -> Values {
        Values::F64(v)
    }
}

impl Real for f32 {
    const ZERO: f32 = 0.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    fn exp(self) -> f32 {
        f32::exp(self)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    fn values(v: Vec<f32>) -> Values {
        Values::F32(v)
    }
}

/// A dtype's precision policy: the accumulator, and rounding to the dtype (values of the
/// dtype are held in the accumulator type, which holds every one of them exactly).
trait Policy {
    type A: Real;
    /// A float64 input or weight (or the scale), rounded to the dtype.
    fn from_f64(x: f64) -> Self::A;
    /// An accumulated value, rounded to the dtype (a stage as stored).
    fn rnd(x: Self::A) -> Self::A;
}

struct Float64;
struct Float32;
struct Float16;
struct BFloat16;

impl Policy for Float64 {
    type A = f64;
    fn from_f64(x: f64) -> f64 {
        x
    }
    #[inline(always)]
    fn rnd(x: f64) -> f64 {
        x
    }
}

impl Policy for Float32 {
    type A = f32;
    fn from_f64(x: f64) -> f32 {
        x as f32 // round to nearest even
    }
    #[inline(always)]
    fn rnd(x: f32) -> f32 {
        x
    }
}

impl Policy for Float16 {
    type A = f32;
    fn from_f64(x: f64) -> f32 {
        dtypes::f16_to_f32(dtypes::f16_bits(x))
    }
    #[inline(always)]
    fn rnd(x: f32) -> f32 {
        dtypes::round_f16(x)
    }
}

impl Policy for BFloat16 {
    type A = f32;
    fn from_f64(x: f64) -> f32 {
        dtypes::bf16_to_f32(dtypes::bf16_bits(x))
    }
    #[inline(always)]
    fn rnd(x: f32) -> f32 {
        dtypes::round_bf16(x)
    }
}

/// Every forward stage of `case`, in pipeline order, in the case's dtype.
pub fn forward(case: &Case, bug: Option<Bug>) -> Vec<Stage> {
    match case.dtype {
        Dtype::F64 => forward_in::<Float64>(case, bug),
        Dtype::F32 => forward_in::<Float32>(case, bug),
        Dtype::F16 => forward_in::<Float16>(case, bug),
        Dtype::BF16 => forward_in::<BFloat16>(case, bug),
    }
}

fn convert<P: Policy>(a: &F64Array) -> Vec<P::A> {
    (0..a.len()).map(|i| P::from_f64(a.get(i))).collect()
}

/// Rows handled together in the loops below, so that each weight row, key column or
/// value row is loaded once for ROWS rows (every element is still summed in order).
const ROWS: usize = 8;

/// rnd(x · w + b) for `rows` rows of `n_in` features (`row(r, buf)` fills row r), w (n_in, n_out).
fn linear<P: Policy>(
    rows: usize,
    n_in: usize,
    row: impl Fn(usize, &mut [P::A]),
    w: &[P::A],
    b: Option<&[P::A]>,
    n_out: usize,
) -> Vec<P::A> {
    let mut y = vec![P::A::ZERO; rows * n_out];
    let mut x = vec![P::A::ZERO; ROWS * n_in];
    for (block, yb) in y.chunks_mut(ROWS * n_out).enumerate() {
        let n = yb.len() / n_out;
        for (r, xr) in x.chunks_mut(n_in).take(n).enumerate() {
            row(block * ROWS + r, xr);
        }
        for (i, wr) in w.chunks(n_out).enumerate() {
            for (yr, xr) in yb.chunks_mut(n_out).zip(x.chunks(n_in)) {
                let xi = xr[i];
                for (acc, &wo) in yr.iter_mut().zip(wr) {
                    *acc += xi * wo;
                }
            }
        }
        for yr in yb.chunks_mut(n_out) {
            if let Some(b) = b {
                for (acc, &bo) in yr.iter_mut().zip(b) {
                    *acc += bo;
                }
            }
            for acc in yr.iter_mut() {
                *acc = P::rnd(*acc);
            }
        }
    }
    y
}

/// A projection of a case input: rnd(rnd(x) · rnd(W) + rnd(b)).
fn project<P: Policy>(case: &Case, input: &str, w: &str, b: &str) -> Vec<P::A> {
    let x = case.input(input);
    let w = case.weight(w);
    let (n_in, n_out) = (w.shape[0], w.shape[1]);
    let wv = convert::<P>(&w);
    let bv = case.bias(b).map(|b| convert::<P>(&b));
    let rows = x.len() / n_in;
    linear::<P>(
        rows,
        n_in,
        |r, buf| {
            for (i, dst) in buf.iter_mut().enumerate() {
                *dst = P::from_f64(x.get(r * n_in + i));
            }
        },
        &wv,
        bv.as_deref(),
        n_out,
    )
}

/// The sizes of the attention core.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    s: usize,
    h: usize,
    g: usize,
    dk: usize,
    dv: usize,
}

fn forward_in<P: Policy>(case: &Case, bug: Option<Bug>) -> Vec<Stage> {
    let c = &case.config;
    let (b, t, s) = (case.batch, case.tgt_len, case.src_len);
    let d = Dims { t, s, h: c.num_heads, g: c.num_kv_heads, dk: c.head_dim, dv: c.value_head_dim };

    let q = project::<P>(case, "query", "w_q", "b_q"); // (B, T, H·D_k)
    let k = project::<P>(case, "key", "w_k", "b_k"); // (B, S, H_kv·D_k)
    let v = project::<P>(case, "value", "w_v", "b_v"); // (B, S, H_kv·D_v)

    let scale = P::from_f64(c.scale);
    // Causal: query i sees keys j < limit(i) = i + off + 1 (the bug: i + off).
    let causal_off: Option<i64> = c.causal.then(|| if c.bottom_right { s as i64 - t as i64 } else { 0 });
    let diagonal = if bug == Some(Bug::CausalDiagonal) { 0 } else { 1 };
    let mask = case.mask();
    let mask = mask.as_ref().map(|m| (m, m.broadcast_strides()));

    let mut scores = vec![P::A::ZERO; b * d.h * t * s];
    let mut attn = vec![P::A::ZERO; b * d.h * t * s];
    let mut heads = vec![P::A::ZERO; b * d.h * t * d.dv];

    // The (b, h) pairs are independent: split them among threads (the results do not
    // depend on how: each element is computed the same way).
    let n_heads = b * d.h;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(n_heads).max(1);
    let per = n_heads.div_ceil(threads);
    std::thread::scope(|scope| {
        let chunks = scores
            .chunks_mut(per * t * s)
            .zip(attn.chunks_mut(per * t * s))
            .zip(heads.chunks_mut(per * t * d.dv))
            .enumerate();
        for (n, ((sc, at), ho)) in chunks {
            let (q, k, v, mask) = (&q, &k, &v, mask);
            scope.spawn(move || {
                let count = sc.len() / (t * s);
                for local in 0..count {
                    let bh = n * per + local;
                    attend_head::<P>(
                        bh,
                        d,
                        scale,
                        q,
                        k,
                        v,
                        mask,
                        causal_off.map(|off| off + diagonal),
                        &mut sc[local * t * s..(local + 1) * t * s],
                        &mut at[local * t * s..(local + 1) * t * s],
                        &mut ho[local * t * d.dv..(local + 1) * t * d.dv],
                    );
                }
            });
        }
    });

    // concat (B, T, H·D_v): head_outputs (B, H, T, D_v) transposed to (B, T, H, D_v).
    let hd = d.h * d.dv;
    let mut concat = vec![P::A::ZERO; b * t * hd];
    for bi in 0..b {
        for h in 0..d.h {
            for i in 0..t {
                let src = &heads[((bi * d.h + h) * t + i) * d.dv..][..d.dv];
                concat[(bi * t + i) * hd + h * d.dv..][..d.dv].copy_from_slice(src);
            }
        }
    }
    let w_o = convert::<P>(&case.weight("w_o"));
    let b_o = case.bias("b_o").map(|x| convert::<P>(&x));
    let output = linear::<P>(b * t, hd, |r, buf| buf.copy_from_slice(&concat[r * hd..(r + 1) * hd]), &w_o, b_o.as_deref(), c.out_dim);

    let stage = |name, shape: Vec<usize>, v: Vec<P::A>| Stage { name, shape, values: P::A::values(v) };
    vec![
        stage("q_proj", vec![b, t, d.h * d.dk], q),
        stage("k_proj", vec![b, s, d.g * d.dk], k),
        stage("v_proj", vec![b, s, d.g * d.dv], v),
        stage("scores", vec![b, d.h, t, s], scores),
        stage("attn_weights", vec![b, d.h, t, s], attn),
        stage("head_outputs", vec![b, d.h, t, d.dv], heads),
        stage("concat", vec![b, t, hd], concat),
        stage("output", vec![b, t, c.out_dim], output),
    ]
}

/// One (batch, query head) pair: its rows of scores and attn_weights (T, S) and of
/// head_outputs (T, D_v).  `causal_limit`: query i sees keys j < i + causal_limit.
#[allow(clippy::too_many_arguments)]
fn attend_head<P: Policy>(
    bh: usize,
    d: Dims,
    scale: P::A,
    q: &[P::A],
    k: &[P::A],
    v: &[P::A],
    mask: Option<(&BoolArray, [usize; 4])>,
    causal_limit: Option<i64>,
    scores: &mut [P::A],
    attn: &mut [P::A],
    out: &mut [P::A],
) {
    let zero = P::A::ZERO;
    let (b, h) = (bh / d.h, bh % d.h);
    let g = h / (d.h / d.g); // the key/value head query head h reads
    let (s, t, dk, dv) = (d.s, d.t, d.dk, d.dv);

    // This head's keys transposed to (D_k, S): a row of scores is then D_k passes of
    // contiguous multiply-adds (each score still sums over d in order).
    let mut kt = vec![zero; dk * s];
    for j in 0..s {
        let row = &k[(b * s + j) * d.g * dk + g * dk..][..dk];
        for (dd, &x) in row.iter().enumerate() {
            kt[dd * s + j] = x;
        }
    }
    const TILE: usize = 256; // key columns per pass, so that the kt tile stays in cache
    let mut acc_o = vec![zero; ROWS * dv];
    let mut limits = [0usize; ROWS];

    for i0 in (0..t).step_by(ROWS) {
        let rows = ROWS.min(t - i0);
        let block = i0 * s..(i0 + rows) * s;

        // scores: every (i, j), visible or not.
        let sblock = &mut scores[block.clone()];
        for j0 in (0..s).step_by(TILE) {
            let j1 = (j0 + TILE).min(s);
            for dd in 0..dk {
                let ktr = &kt[dd * s + j0..dd * s + j1];
                for (r, srow) in sblock.chunks_mut(s).enumerate() {
                    let qd = q[(b * t + i0 + r) * d.h * dk + h * dk + dd];
                    for (x, &kv) in srow[j0..j1].iter_mut().zip(ktr) {
                        *x += qd * kv;
                    }
                }
            }
        }
        for x in sblock.iter_mut() {
            *x = P::rnd(*x * scale);
        }

        for (r, (srow, prow)) in sblock.chunks(s).zip(attn[block.clone()].chunks_mut(s)).enumerate() {
            let i = i0 + r;
            // Which keys query i sees: j < limit, and the mask.
            let limit = match causal_limit {
                None => s,
                Some(l) => (i as i64 + l).clamp(0, s as i64) as usize,
            };
            limits[r] = limit;
            let visible = |j: usize| match mask {
                None => true,
                Some((m, st)) => m.get(b * st[0] + h * st[1] + i * st[2] + j * st[3]),
            };

            // Softmax over the visible keys, in the accumulator; 0 elsewhere.
            let mut peak = P::A::NEG_INF;
            for (j, &x) in srow[..limit].iter().enumerate() {
                if x > peak && visible(j) {
                    peak = x;
                }
            }
            if !peak.is_finite() {
                peak = zero; // a row that sees no key (as numpy_mha.py)
            }
            let mut denom = zero;
            for (j, (p, &x)) in prow[..limit].iter_mut().zip(srow).enumerate() {
                if visible(j) {
                    *p = (x - peak).exp();
                    denom += *p;
                }
            }
            if denom > zero {
                for p in prow[..limit].iter_mut() {
                    *p = P::rnd(*p / denom);
                }
            } else {
                prow[..limit].fill(zero);
            }
        }

        // head_outputs: Σ_j p · v, from p as stored.
        acc_o.fill(zero);
        let pblock = &attn[block];
        let last = limits[..rows].iter().copied().max().unwrap_or(0);
        for j in 0..last {
            let vrow = &v[(b * s + j) * d.g * dv + g * dv..][..dv];
            for (r, acc) in acc_o.chunks_mut(dv).take(rows).enumerate() {
                let p = pblock[r * s + j];
                if p != zero {
                    for (o, &x) in acc.iter_mut().zip(vrow) {
                        *o += p * x;
                    }
                }
            }
        }
        for (dst, &x) in out[i0 * dv..(i0 + rows) * dv].iter_mut().zip(&acc_o) {
            *dst = P::rnd(x);
        }
    }
}
