#!/usr/bin/env node
/*
 * mha.js: a reference mhaspec worker program in JavaScript (Node.js, tested with 20; no packages).
 *
 * It speaks mhaspec-wire/1 (docs/protocol.md) and computes multi-head attention the way
 * mhaspec's numpy adapter does (src/mhaspec/adapters/numpy_mha.py): every stage stored in the
 * dtype under test, every product sum accumulated in float32 for float16 and bfloat16 (in the
 * dtype itself for float32 and float64). It computes the forward pass only.
 *
 * Build:  nothing to build (plain Node.js; no package.json, no dependencies).
 * Run:    mhaspec run "exec:node examples/exec/js/mha.js"       (from the repository root)
 *         mhaspec run "exec:examples/exec/js/mha.js"            (the same, by its #! line)
 *         mhaspec run "exec:node examples/exec/js/mha.js" -k gqa --dtype float16
 * Bug:    mhaspec run "exec:node examples/exec/js/mha.js --bug concat-order"
 *         plants one bug: concat is laid out with the head index fastest (element e·H + h
 *         instead of h·D_v + e), so the first failing stage is `concat`. The name in `ready`
 *         becomes js-mha[bug:concat-order]. Any other argument is a usage error (exit 2).
 *
 * mhaspec starts this program with stdin = /dev/null and its stdout and stderr on the user's
 * terminal (print freely there); MHASPEC_WIRE_FDS="READ_FD,WRITE_FD" names the two pipes the
 * protocol uses. Without that variable it prints one line and exits 2.
 *
 * The file has three parts:
 *   1. the protocol: frames, safetensors, the request loop (keep it as it is);
 *   2. dtypes: correctly rounded float32 -> float16 / bfloat16, and float64 -> either;
 *   3. the attention: `attention(c, bug)` computes the 8 forward stages of one case. This is
 *      the part to replace with a call into your own kernel: it gets the case's arrays already
 *      converted to the case's dtype (see `caseFromRequest`) and returns one typed array per
 *      stage, C order, each value representable in that dtype.
 * Little-endian hosts only (typed arrays are read and written in the host's byte order).
 */
'use strict';

const fs = require('fs');
const os = require('os');

const PROTOCOL = 'mhaspec-wire/1';
const NAME = 'js-mha';
const DTYPES = ['float64', 'float32', 'float16', 'bfloat16'];
const STAGES = ['q_proj', 'k_proj', 'v_proj', 'scores', 'attn_weights', 'head_outputs', 'concat', 'output'];
const BUGS = ['concat-order'];
const USAGE = 'usage: node mha.js [--bug ' + BUGS.join('|') + ']';

/* ======================================================================================
 * Part 1. The protocol (docs/protocol.md)
 * ====================================================================================== */

class CaseError extends Error {} // a case this worker cannot compute: a failed `run` reply, then go on

const MAX_HEADER = 2 ** 24;
const MAX_PAYLOAD = 2 ** 40;
const CHUNK = 1 << 30; // fs.readSync / fs.writeSync take at most 2^31 - 1 bytes at a time

function sleepMs(ms) {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

/* Exactly n bytes from fd into a fresh Buffer (its own ArrayBuffer, at offset 0, so typed
 * arrays can view it when aligned). null at end of file before the first byte. */
function readExact(fd, n, eofOk) {
  const buf = Buffer.allocUnsafeSlow(n);
  let got = 0;
  while (got < n) {
    let k;
    try {
      k = fs.readSync(fd, buf, got, Math.min(n - got, CHUNK), null);
    } catch (err) {
      if (err.code === 'EAGAIN' || err.code === 'EINTR') { sleepMs(1); continue; }
      throw err;
    }
    if (k === 0) {
      if (got === 0 && eofOk) return null;
      throw new Error('end of file in the middle of a message');
    }
    got += k;
  }
  return buf;
}

function writeAll(fd, bytes) { // bytes: a Buffer or a typed array
  const buf = Buffer.isBuffer(bytes) ? bytes : Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let put = 0;
  while (put < buf.length) {
    try {
      put += fs.writeSync(fd, buf, put, Math.min(buf.length - put, CHUNK));
    } catch (err) {
      if (err.code === 'EAGAIN' || err.code === 'EINTR') { sleepMs(1); continue; }
      throw err;
    }
  }
}

function getU64(buf, off) {
  const lo = buf.readUInt32LE(off), hi = buf.readUInt32LE(off + 4);
  return hi * 2 ** 32 + lo; // exact below 2^53; anything that large is refused anyway
}

function putU64(buf, off, v) {
  buf.writeUInt32LE(v % 2 ** 32, off);
  buf.writeUInt32LE(Math.floor(v / 2 ** 32), off + 4);
}

/* One frame: {header (parsed JSON), payload (Buffer)}; null at end of file. */
function readFrame(fd) {
  const head = readExact(fd, 16, true);
  if (head === null) return null;
  const h = getU64(head, 0), p = getU64(head, 8);
  if (h > MAX_HEADER || p > MAX_PAYLOAD) throw new Error(`not a frame (header ${h} bytes, payload ${p} bytes)`);
  const header = JSON.parse(readExact(fd, h).toString('utf8'));
  const payload = p ? readExact(fd, p) : Buffer.alloc(0);
  return { header, payload };
}

/* One frame: header (an object) and the payload as a list of byte chunks, written in order
 * (or a function producing them one by one, so big stages need not be copied all at once). */
function writeFrame(fd, header, chunks = [], payloadLength = 0) {
  const text = Buffer.from(JSON.stringify(header), 'utf8');
  const head = Buffer.alloc(16);
  putU64(head, 0, text.length);
  putU64(head, 8, payloadLength);
  writeAll(fd, Buffer.concat([head, text]));
  for (const chunk of (typeof chunks === 'function' ? chunks() : chunks)) writeAll(fd, chunk);
}

/* safetensors (section 5): name -> {dtype, shape, bytes (a Uint8Array view of payload)}.
 * Tensors may come in any order: each one is where its data_offsets say. */
const ITEMSIZE = { F64: 8, F32: 4, F16: 2, BF16: 2, F8_E4M3: 1, F8_E5M2: 1, BOOL: 1,
  I8: 1, I16: 2, I32: 4, I64: 8, U8: 1, U16: 2, U32: 4, U64: 8 };

function parseSafetensors(payload) {
  const tensors = new Map();
  if (payload.length === 0) return tensors;
  if (payload.length < 8) throw new CaseError('the payload is shorter than a safetensors header');
  const n = getU64(payload, 0);
  if (8 + n > payload.length) throw new CaseError('the safetensors header runs past the payload');
  const meta = JSON.parse(payload.toString('utf8', 8, 8 + n)); // may be padded with spaces: JSON allows it
  const base = 8 + n;
  for (const [name, info] of Object.entries(meta)) {
    if (name === '__metadata__') continue;
    const { dtype, shape, data_offsets: [start, end] } = info;
    if (!(dtype in ITEMSIZE)) throw new CaseError(`${name}: unknown safetensors dtype ${dtype}`);
    const count = shape.reduce((a, b) => a * b, 1);
    if (end - start !== count * ITEMSIZE[dtype] || start < 0 || base + end > payload.length)
      throw new CaseError(`${name}: data_offsets [${start}, ${end}] do not fit shape [${shape}] ${dtype}`);
    tensors.set(name, { dtype, shape, bytes: new Uint8Array(payload.buffer, payload.byteOffset + base + start, end - start) });
  }
  return tensors;
}

/* A typed array over a tensor's bytes: a view when aligned, else a copy. */
function typedView(Type, bytes) {
  if (bytes.byteOffset % Type.BYTES_PER_ELEMENT === 0)
    return new Type(bytes.buffer, bytes.byteOffset, bytes.byteLength / Type.BYTES_PER_ELEMENT);
  return new Type(bytes.slice().buffer);
}

/* A case tensor (F64, or F32) as the case's dtype: Float64Array for float64, else a Float32Array
 * holding values of that dtype. Case data is exactly representable, but it is rounded anyway. */
function tensorIn(t, name, dtype) {
  let src;
  if (t.dtype === 'F64') src = typedView(Float64Array, t.bytes);
  else if (t.dtype === 'F32') src = typedView(Float32Array, t.bytes);
  else throw new CaseError(`${name} is ${t.dtype}, not F64`);
  if (dtype === 'float64') return src instanceof Float64Array ? src : Float64Array.from(src);
  const round = ROUND_FROM_F64[dtype];
  const out = new Float32Array(src.length);
  for (let i = 0; i < src.length; i++) out[i] = round(src[i]);
  return out;
}

/* The case's dtype -> its safetensors code and how to write its values. */
const CODES = { float64: 'F64', float32: 'F32', float16: 'F16', bfloat16: 'BF16' };

function stageBytes(dtype, a) {
  if (dtype === 'float64') return a instanceof Float64Array ? a : Float64Array.from(a);
  if (dtype === 'float32') return a instanceof Float32Array ? a : Float32Array.from(a);
  const bits = dtype === 'float16' ? f32ToF16Bits : f32ToBf16Bits;
  const out = new Uint16Array(a.length);
  for (let i = 0; i < a.length; i++) out[i] = bits(a[i]);
  return out;
}

/* The reply's payload: a safetensors header padded with spaces to a multiple of 8, the tensors
 * back to back. Returns {length, chunks} where chunks() yields the bytes stage by stage. */
function packStages(dtype, stages, shapes) {
  const item = ITEMSIZE[CODES[dtype]];
  const meta = {};
  let off = 0;
  for (const name of STAGES) {
    const size = stages[name].length * item;
    meta[name] = { dtype: CODES[dtype], shape: shapes[name], data_offsets: [off, off + size] };
    off += size;
  }
  let text = JSON.stringify(meta);
  text += ' '.repeat((8 - (Buffer.byteLength(text) % 8)) % 8);
  const head = Buffer.alloc(8 + Buffer.byteLength(text));
  putU64(head, 0, Buffer.byteLength(text));
  head.write(text, 8, 'utf8');
  return {
    length: head.length + off,
    *chunks() {
      yield head;
      for (const name of STAGES) yield stageBytes(dtype, stages[name]);
    },
  };
}

/* The config keys this worker knows; any other must be at its default (section 7). */
const KNOWN_CONFIG = new Set(['d_model', 'num_heads', 'kdim', 'vdim', 'num_kv_heads', 'head_dim',
  'value_head_dim', 'out_dim', 'bias', 'scale', 'causal', 'causal_alignment']);

function isDefault(v) {
  return v === null || v === false || v === 0;
}

function positiveInt(obj, where, key) {
  const v = obj[key];
  if (!Number.isInteger(v) || v < 1) throw new CaseError(`${where}.${key} = ${JSON.stringify(v)} is not a positive integer`);
  return v;
}

/* A case request -> the case `attention` computes: sizes, config, arrays in the case's dtype. */
function caseFromRequest(caseHeader, payload) {
  const { scalars, config: cfg, aliases = {} } = caseHeader;
  for (const [key, v] of Object.entries(cfg))
    if (!KNOWN_CONFIG.has(key) && !isDefault(v))
      throw new CaseError(`config.${key} = ${JSON.stringify(v)} is not known to ${NAME} (it computes only the default)`);
  const dtype = scalars.dtype;
  if (!DTYPES.includes(dtype)) throw new CaseError(`unknown dtype ${JSON.stringify(dtype)}`);
  const c = {
    id: scalars.id, dtype,
    B: positiveInt(scalars, 'scalars', 'batch'), T: positiveInt(scalars, 'scalars', 'tgt_len'),
    S: positiveInt(scalars, 'scalars', 'src_len'), dModel: positiveInt(cfg, 'config', 'd_model'),
    kdim: positiveInt(cfg, 'config', 'kdim'), vdim: positiveInt(cfg, 'config', 'vdim'),
    H: positiveInt(cfg, 'config', 'num_heads'), G: positiveInt(cfg, 'config', 'num_kv_heads'),
    Dk: positiveInt(cfg, 'config', 'head_dim'), Dv: positiveInt(cfg, 'config', 'value_head_dim'),
    dOut: positiveInt(cfg, 'config', 'out_dim'),
    bias: cfg.bias === true, scale: cfg.scale, causal: cfg.causal === true,
    alignment: cfg.causal_alignment,
  };
  if (c.H % c.G !== 0) throw new CaseError(`num_heads ${c.H} is not a multiple of num_kv_heads ${c.G}`);
  if (typeof c.scale !== 'number' || !(c.scale > 0)) throw new CaseError(`config.scale = ${JSON.stringify(c.scale)} is not a positive number`);
  if (c.causal && c.alignment !== 'top_left' && c.alignment !== 'bottom_right')
    throw new CaseError(`config.causal_alignment = ${JSON.stringify(c.alignment)} is neither top_left nor bottom_right`);

  const tensors = parseSafetensors(payload);
  const get = (name, shape) => {
    let key = name;
    for (let hops = 0; hops < 4 && key.startsWith('input.') && aliases[key.slice(6)] !== undefined; hops++)
      key = 'input.' + aliases[key.slice(6)]; // an alias: the same array as the named input
    const t = tensors.get(key);
    if (t === undefined) throw new CaseError(`the payload has no ${key}${key !== name ? ` (for ${name})` : ''}`);
    if (shape && (t.shape.length !== shape.length || t.shape.some((d, i) => d !== shape[i])))
      throw new CaseError(`${key} has shape [${t.shape}], expected [${shape}]`);
    return t;
  };
  const { B, T, S, H, G, Dk, Dv } = c;
  c.query = tensorIn(get('input.query', [B, T, c.dModel]), 'input.query', dtype);
  c.key = tensorIn(get('input.key', [B, S, c.kdim]), 'input.key', dtype);
  c.value = tensorIn(get('input.value', [B, S, c.vdim]), 'input.value', dtype);
  c.w_q = tensorIn(get('weight.w_q', [c.dModel, H * Dk]), 'weight.w_q', dtype);
  c.w_k = tensorIn(get('weight.w_k', [c.kdim, G * Dk]), 'weight.w_k', dtype);
  c.w_v = tensorIn(get('weight.w_v', [c.vdim, G * Dv]), 'weight.w_v', dtype);
  c.w_o = tensorIn(get('weight.w_o', [H * Dv, c.dOut]), 'weight.w_o', dtype);
  for (const [b, n] of [['b_q', H * Dk], ['b_k', G * Dk], ['b_v', G * Dv], ['b_o', c.dOut]])
    c[b] = c.bias ? tensorIn(get('weight.' + b, [n]), 'weight.' + b, dtype) : null;

  // The mask: BOOL, 4-D, broadcastable to (B, H, T, S); true = may attend. Kept as the bytes
  // and a stride per axis (0 where it broadcasts).
  c.mask = null;
  if (tensors.has('input.mask') || aliases.mask !== undefined) {
    const m = get('input.mask');
    if (m.dtype !== 'BOOL') throw new CaseError(`input.mask is ${m.dtype}, not BOOL`);
    const full = [B, H, T, S];
    if (m.shape.length !== 4 || m.shape.some((d, i) => d !== 1 && d !== full[i]))
      throw new CaseError(`input.mask has shape [${m.shape}], not broadcastable to [${full}]`);
    const strides = [0, 0, 0, 0];
    for (let i = 3, s = 1; i >= 0; s *= m.shape[i], i--) strides[i] = m.shape[i] === 1 ? 0 : s;
    c.mask = { data: m.bytes.slice(), strides }; // a copy: the payload need not outlive the parse
  }
  return c;
}

function stageShapes(c) {
  const { B, T, S, H, G, Dk, Dv, dOut } = c;
  return {
    q_proj: [B, T, H * Dk], k_proj: [B, S, G * Dk], v_proj: [B, S, G * Dv],
    scores: [B, H, T, S], attn_weights: [B, H, T, S], head_outputs: [B, H, T, Dv],
    concat: [B, T, H * Dv], output: [B, T, dOut],
  };
}

function oneLine(err) { // an exception as one line naming the cause and where
  const msg = String(err && err.message !== undefined ? err.message : err).replace(/\s+/g, ' ');
  if (err instanceof CaseError || !err || !err.stack) return msg;
  const at = err.stack.split('\n').find((l) => /^\s+at /.test(l));
  const where = at ? at.trim().replace(/^at /, '').replace(/\(.*[\\/]/, '(') : '';
  return `${err.name}: ${msg}${where ? ` (${where})` : ''}`;
}

function describeEnvironment() {
  return {
    process: 'exec', language: 'JavaScript', runtime: 'node ' + process.version,
    v8: process.versions.v8, platform: `${process.platform} ${os.release()}`, arch: process.arch,
    cpu: { model: (os.cpus()[0] || {}).model || null, count: os.cpus().length }, threads: 1,
  };
}

function main(argv) {
  let bug = null;
  if (argv.length === 2 && argv[0] === '--bug' && BUGS.includes(argv[1])) bug = argv[1];
  else if (argv.length !== 0) {
    process.stderr.write(`mha.js: bad arguments ${JSON.stringify(argv)}; ${USAGE}\n`);
    return 2;
  }
  const m = /^(\d+),(\d+)$/.exec(process.env.MHASPEC_WIRE_FDS || '');
  if (!m) {
    process.stderr.write(`mha.js: MHASPEC_WIRE_FDS is ${process.env.MHASPEC_WIRE_FDS === undefined ? 'not set' : JSON.stringify(process.env.MHASPEC_WIRE_FDS)}; it must be READ_FD,WRITE_FD (this program is started by mhaspec run "exec:node mha.js")\n`);
    return 2;
  }
  const rfd = Number(m[1]), wfd = Number(m[2]);
  if (os.endianness() !== 'LE') {
    writeFrame(wfd, { reply: 'ready', protocol: PROTOCOL, ok: false, error: 'mha.js runs on little-endian hosts only' });
    return 1;
  }
  const name = bug ? `${NAME}[bug:${bug}]` : NAME;
  writeFrame(wfd, {
    reply: 'ready', protocol: PROTOCOL, ok: true, name, dtypes: DTYPES, deviations: [],
    framework: null, framework_version: null, has_supports: false, has_backward: false,
    environment: describeEnvironment(),
  });

  let last = null; // the last case: {case} or {error}, for requests with "reuse": true
  for (;;) {
    let frame = readFrame(rfd);
    if (frame === null) return 0; // end of file: the runner is done
    const header = frame.header, op = header.op;
    if (op === 'close') return 0;
    // every reply echoes the request's number, so the runner can tell a reply to another request apart
    const answer = (h, ...rest) => writeFrame(wfd, Number.isInteger(header.seq) ? { ...h, seq: header.seq } : h, ...rest);
    if (header.case !== undefined) { // a new case: keep it, or why it cannot be computed
      last = null; // drop the previous case first: one case in memory at a time
      try { last = { case: caseFromRequest(header.case, frame.payload) }; } catch (err) { last = { error: oneLine(err) }; }
      frame = null; // float64 arrays are views of the payload; other dtypes were converted: let it go
    } else if (header.reuse !== true) {
      answer({ reply: 'run', ok: false, error: `a ${JSON.stringify(op)} request with neither a case nor "reuse": true` });
      continue;
    }
    if (op !== 'run') { // never sent: ready says has_supports and has_backward are false
      const step = typeof op === 'string' && op.startsWith('supports') ? 'supports' : op === 'backward' ? 'backward' : 'run';
      answer({ reply: step, ok: false, error: `${name} answers only run (and close), not ${JSON.stringify(op)}` });
      continue;
    }
    if (last === null) { answer({ reply: 'run', ok: false, error: 'reuse: no case was sent before' }); continue; }
    if (last.error !== undefined) { answer({ reply: 'run', ok: false, error: last.error }); continue; }
    const c = last.case;
    let packed, seconds;
    try {
      const t0 = process.hrtime.bigint();
      const stages = attention(c, bug);
      seconds = Number(process.hrtime.bigint() - t0) / 1e9;
      const shapes = stageShapes(c);
      for (const s of STAGES) {
        const n = shapes[s].reduce((a, b) => a * b, 1);
        if (!stages[s] || stages[s].length !== n) throw new Error(`stage ${s} has ${stages[s] ? stages[s].length : 'no'} elements, expected ${n}`);
      }
      packed = packStages(c.dtype, stages, shapes);
    } catch (err) {
      answer({ reply: 'run', ok: false, error: oneLine(err) });
      continue;
    }
    answer({ reply: 'run', ok: true, seconds, mapping: true, keys: STAGES.slice(), special: {} },
      () => packed.chunks(), packed.length);
  }
}

/* ======================================================================================
 * Part 2. dtypes: rounding to float16 and bfloat16, round to nearest, ties to even
 * ====================================================================================== */

const f32buf = new Float32Array(1);
const u32buf = new Uint32Array(f32buf.buffer);

/* float32 value -> IEEE binary16 bits (subnormals, overflow to inf, NaN kept quiet). */
function f32ToF16Bits(x) {
  f32buf[0] = x;
  const u = u32buf[0];
  const sign = (u >>> 16) & 0x8000;
  const exp = (u >>> 23) & 0xff, man = u & 0x7fffff;
  if (exp === 0xff) return sign | (man ? 0x7e00 : 0x7c00);
  const e = exp - 127;
  if (e > 15) return sign | 0x7c00; // |x| >= 2^16: overflow
  if (e >= -14) { // a normal float16 (rounding may carry into the exponent, up to inf)
    let h = ((e + 15) << 10) | (man >>> 13);
    const rest = man & 0x1fff;
    if (rest > 0x1000 || (rest === 0x1000 && (h & 1))) h++;
    return sign | h;
  }
  if (exp === 0) return sign; // a float32 zero or subnormal: far below half of 2^-24
  const m = man | 0x800000, shift = -e - 1; // x = m · 2^(e-23); in units of 2^-24: m >> shift
  if (shift > 24) return sign;
  let h = m >>> shift;
  const rest = m & ((1 << shift) - 1), half = 1 << (shift - 1);
  if (rest > half || (rest === half && (h & 1))) h++; // may become the smallest normal: right
  return sign | h;
}

/* float32 value -> bfloat16 bits (the upper 16 bits of the rounded binary32). */
function f32ToBf16Bits(x) {
  f32buf[0] = x;
  const u = u32buf[0];
  if ((u & 0x7fffffff) > 0x7f800000) return ((u >>> 16) | 0x40) & 0xffff; // NaN, quiet
  return ((u + 0x7fff + ((u >>> 16) & 1)) >>> 16) & 0xffff;
}

const F16_VALUES = new Float32Array(65536); // float16 bits -> value
for (let h = 0; h < 65536; h++) {
  const s = h & 0x8000 ? -1 : 1, e = (h >>> 10) & 0x1f, m = h & 0x3ff;
  F16_VALUES[h] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m ? NaN : s * Infinity) : s * (1024 + m) * 2 ** (e - 25);
}

function bf16BitsToF32(h) {
  u32buf[0] = h << 16;
  return f32buf[0];
}

/* A float64 value rounded to float32 with round-to-odd: rounding that to float16 or bfloat16
 * is then the correct rounding of the float64 value (float32 has more than 2 bits to spare). */
function f32RoundToOdd(x) {
  const f = Math.fround(x);
  if (f === x || f !== f || f === Infinity || f === -Infinity) return f;
  f32buf[0] = f;
  if (u32buf[0] & 1) return f;
  u32buf[0] += Math.abs(f) > Math.abs(x) ? -1 : 1; // the odd neighbour on x's side
  return f32buf[0];
}

const roundF16 = (x) => F16_VALUES[f32ToF16Bits(x)]; // a float32 value -> nearest float16, as float32
const roundBf16 = (x) => bf16BitsToF32(f32ToBf16Bits(x));
const identity = (x) => x;

/* Store a stage value (already in the accumulator: float64 or float32) in the dtype. */
const ROUND_FROM_ACC = { float64: identity, float32: identity, float16: roundF16, bfloat16: roundBf16 };
/* A float64 value (the case's arrays, the scale) -> the dtype. */
const ROUND_FROM_F64 = {
  float64: identity, float32: Math.fround,
  float16: (x) => roundF16(f32RoundToOdd(x)), bfloat16: (x) => roundBf16(f32RoundToOdd(x)),
};

/* ======================================================================================
 * Part 3. The attention (docs/spec.md section 2). Replace `attention` with your kernel.
 *
 * c: B, T, S, dModel, kdim, vdim, H (query heads), G (key/value heads), Dk, Dv, dOut, bias,
 *    scale (float64), causal, alignment ('top_left' | 'bottom_right'), dtype;
 *    query (B,T,dModel), key (B,S,kdim), value (B,S,vdim), w_q (dModel,H·Dk), w_k (kdim,G·Dk),
 *    w_v (vdim,G·Dv), w_o (H·Dv,dOut), b_q b_k b_v b_o (null without bias): C-order typed
 *    arrays of values in c.dtype (Float64Array for float64, else Float32Array);
 *    mask: null, or {data: Uint8Array of 0/1, strides: [sb, sh, st, ss]} over (B,H,T,S).
 * Returns {q_proj, k_proj, v_proj, scores, attn_weights, head_outputs, concat, output}.
 *
 * Precision, as mhaspec's numpy adapter: acc = float32 for float16/bfloat16, else the dtype;
 * every product sum accumulates in acc (float32: Math.fround after every operation) and each
 * stage is rounded to the dtype once, when stored.
 * ====================================================================================== */

const fround = Math.fround;

/* y (rows, n) = x (rows, k) · Bᵀ, B (n, k): y[r][o] = Σ_i x[xoff + r·xs + i] · B[boff + o·bs + i],
 * summed over i in order, in float32 (Math.fround after every operation). Blocks of 2 rows ×
 * 4 columns keep 8 sums in registers (the same sums, fewer loads); the rest one by one. */
function matmulF32(x, xoff, xs, rows, k, B, boff, bs, n, y, yoff) {
  for (let r = 0; r < rows; r += 2) {
    const xa = xoff + r * xs, xb = xa + xs, ya = yoff + r * n, yb = ya + n, pair = r + 1 < rows;
    let o = 0;
    if (pair) {
      for (; o + 4 <= n; o += 4) {
        const b0 = boff + o * bs, b1 = b0 + bs, b2 = b1 + bs, b3 = b2 + bs;
        let s0 = 0, s1 = 0, s2 = 0, s3 = 0, t0 = 0, t1 = 0, t2 = 0, t3 = 0;
        for (let i = 0; i < k; i++) {
          const a = x[xa + i], b = x[xb + i], c0 = B[b0 + i], c1 = B[b1 + i], c2 = B[b2 + i], c3 = B[b3 + i];
          s0 = fround(s0 + fround(a * c0)); s1 = fround(s1 + fround(a * c1));
          s2 = fround(s2 + fround(a * c2)); s3 = fround(s3 + fround(a * c3));
          t0 = fround(t0 + fround(b * c0)); t1 = fround(t1 + fround(b * c1));
          t2 = fround(t2 + fround(b * c2)); t3 = fround(t3 + fround(b * c3));
        }
        y[ya + o] = s0; y[ya + o + 1] = s1; y[ya + o + 2] = s2; y[ya + o + 3] = s3;
        y[yb + o] = t0; y[yb + o + 1] = t1; y[yb + o + 2] = t2; y[yb + o + 3] = t3;
      }
    }
    for (; o < n; o++) {
      const bo = boff + o * bs;
      let s = 0;
      for (let i = 0; i < k; i++) s = fround(s + fround(x[xa + i] * B[bo + i]));
      y[ya + o] = s;
      if (pair) {
        let t = 0;
        for (let i = 0; i < k; i++) t = fround(t + fround(x[xb + i] * B[bo + i]));
        y[yb + o] = t;
      }
    }
  }
}

/* The same in float64. */
function matmulF64(x, xoff, xs, rows, k, B, boff, bs, n, y, yoff) {
  for (let r = 0; r < rows; r += 2) {
    const xa = xoff + r * xs, xb = xa + xs, ya = yoff + r * n, yb = ya + n, pair = r + 1 < rows;
    let o = 0;
    if (pair) {
      for (; o + 4 <= n; o += 4) {
        const b0 = boff + o * bs, b1 = b0 + bs, b2 = b1 + bs, b3 = b2 + bs;
        let s0 = 0, s1 = 0, s2 = 0, s3 = 0, t0 = 0, t1 = 0, t2 = 0, t3 = 0;
        for (let i = 0; i < k; i++) {
          const a = x[xa + i], b = x[xb + i], c0 = B[b0 + i], c1 = B[b1 + i], c2 = B[b2 + i], c3 = B[b3 + i];
          s0 += a * c0; s1 += a * c1; s2 += a * c2; s3 += a * c3;
          t0 += b * c0; t1 += b * c1; t2 += b * c2; t3 += b * c3;
        }
        y[ya + o] = s0; y[ya + o + 1] = s1; y[ya + o + 2] = s2; y[ya + o + 3] = s3;
        y[yb + o] = t0; y[yb + o + 1] = t1; y[yb + o + 2] = t2; y[yb + o + 3] = t3;
      }
    }
    for (; o < n; o++) {
      const bo = boff + o * bs;
      let s = 0;
      for (let i = 0; i < k; i++) s += x[xa + i] * B[bo + i];
      y[ya + o] = s;
      if (pair) {
        let t = 0;
        for (let i = 0; i < k; i++) t += x[xb + i] * B[bo + i];
        y[yb + o] = t;
      }
    }
  }
}

function attention(c, bug) {
  const { B, T, S, H, G, Dk, Dv, dOut, dtype } = c;
  const acc32 = dtype !== 'float64'; // accumulate in float32 (float32, float16, bfloat16) or float64
  const Arr = acc32 ? Float32Array : Float64Array; // storage: float16/bfloat16 values live in float32
  const matmul = acc32 ? matmulF32 : matmulF64;
  const rnd = ROUND_FROM_ACC[dtype]; // an accumulator value -> the dtype
  const group = H / G; // query head h reads key/value head floor(h / group) (GQA)

  // y (rows, nout) = rnd(x · W + b), summed in acc
  const linear = (x, rows, nin, W, nout, b) => {
    const Wt = new Arr(nout * nin); // W transposed: column o of W is row o of Wt
    for (let i = 0; i < nin; i++) for (let o = 0; o < nout; o++) Wt[o * nin + i] = W[i * nout + o];
    const y = new Arr(rows * nout);
    matmul(x, 0, nin, rows, nin, Wt, 0, nin, nout, y, 0);
    for (let r = 0; r < rows; r++)
      for (let o = 0, yo = r * nout; o < nout; o++) {
        const s = b === null ? y[yo + o] : acc32 ? fround(y[yo + o] + b[o]) : y[yo + o] + b[o];
        y[yo + o] = rnd(s);
      }
    return y;
  };

  const q = linear(c.query, B * T, c.dModel, c.w_q, H * Dk, c.b_q); // (B, T, H·Dk)
  const k = linear(c.key, B * S, c.kdim, c.w_k, G * Dk, c.b_k); // (B, S, G·Dk)
  const v = linear(c.value, B * S, c.vdim, c.w_v, G * Dv, c.b_v); // (B, S, G·Dv)

  const scale = ROUND_FROM_F64[dtype](c.scale); // the scale in the dtype, used in acc
  const off = c.alignment === 'bottom_right' ? S - T : 0; // causal: query i sees keys j <= i + off
  const mask = c.mask;

  const scores = new Arr(B * H * T * S); // (B, H, T, S): every entry, visible or not
  const attn = new Arr(B * H * T * S); // (B, H, T, S): 0 where not visible
  const heads = new Arr(B * H * T * Dv); // (B, H, T, Dv)
  const Vt = new Arr(Dv * S); // value head g transposed: (Dv, S)
  const e = new Arr(S);

  for (let b = 0; b < B; b++) {
    for (let h = 0; h < H; h++) {
      const g = Math.floor(h / group);
      if (h % group === 0)
        for (let j = 0; j < S; j++)
          for (let d = 0, vo = ((b * S + j) * G + g) * Dv; d < Dv; d++) Vt[d * S + j] = v[vo + d];
      const so = (b * H + h) * T * S; // this (b, h)'s (T, S) block

      // scores = rnd((Q_h · K_gᵀ, summed over d in acc) · scale): Q_h, K_g the head's columns of q, k
      matmul(q, b * T * H * Dk + h * Dk, H * Dk, T, Dk, k, b * S * G * Dk + g * Dk, G * Dk, S, scores, so);
      for (let x = so; x < so + T * S; x++) scores[x] = rnd(acc32 ? fround(scores[x] * scale) : scores[x] * scale);

      // attn_weights: softmax over the visible keys (causal rule AND mask), in acc
      for (let i = 0; i < T; i++) {
        const row = so + i * S;
        const last = c.causal ? Math.min(S - 1, i + off) : S - 1; // keys past it are hidden
        const mo = mask ? b * mask.strides[0] + h * mask.strides[1] + i * mask.strides[2] : 0;
        const ms = mask ? mask.strides[3] : 0;
        let peak = -Infinity, seen = 0;
        for (let j = 0; j <= last; j++) {
          if (mask && !mask.data[mo + j * ms]) continue;
          seen++;
          if (scores[row + j] > peak) peak = scores[row + j];
        }
        if (seen === 0) continue; // a row that sees no key: attn_weights stay 0
        let sum = 0;
        for (let j = 0; j <= last; j++) {
          if (mask && !mask.data[mo + j * ms]) { e[j] = 0; continue; }
          if (acc32) { e[j] = fround(Math.exp(fround(scores[row + j] - peak))); sum = fround(sum + e[j]); }
          else { e[j] = Math.exp(scores[row + j] - peak); sum += e[j]; }
        }
        for (let j = 0; j <= last; j++) attn[row + j] = rnd(acc32 ? fround(e[j] / sum) : e[j] / sum);
      }

      // head_outputs = rnd(P · V_g, summed over j in acc), P = attn_weights as stored
      const ho = (b * H + h) * T * Dv;
      matmul(attn, so, S, T, S, Vt, 0, S, Dv, heads, ho);
      for (let x = ho; x < ho + T * Dv; x++) heads[x] = rnd(heads[x]);
    }
  }

  // concat (B, T, H·Dv): the heads in head order, head h owning columns [h·Dv, (h+1)·Dv)
  const concat = new Arr(B * T * H * Dv);
  for (let b = 0; b < B; b++)
    for (let h = 0; h < H; h++)
      for (let i = 0; i < T; i++)
        for (let d = 0; d < Dv; d++) {
          const col = bug === 'concat-order' ? d * H + h : h * Dv + d; // the planted bug: head index fastest
          concat[(b * T + i) * H * Dv + col] = heads[((b * H + h) * T + i) * Dv + d];
        }

  const output = linear(concat, B * T, H * Dv, c.w_o, dOut, c.b_o); // (B, T, dOut)
  return { q_proj: q, k_proj: k, v_proj: v, scores, attn_weights: attn, head_outputs: heads, concat, output };
}

/* ====================================================================================== */

if (require.main === module) {
  let code;
  try {
    code = main(process.argv.slice(2));
  } catch (err) {
    if (err && (err.code === 'EPIPE' || err.code === 'EBADF')) code = 1; // the runner is gone
    else { process.stderr.write(`mha.js: ${oneLine(err)}\n`); code = 1; }
  }
  process.exitCode = code;
}

// For tests and benchmarks: require('./mha.js') runs nothing.
module.exports = { attention, caseFromRequest, f32ToF16Bits, f32ToBf16Bits, f32RoundToOdd, ROUND_FROM_F64 };
