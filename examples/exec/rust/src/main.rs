//! mha-rust: a reference worker program for mhaspec, in Rust with std only.
//!
//! A complete multi-head attention (every forward stage of docs/spec.md §2, in float64,
//! float32, float16 and bfloat16) behind the mhaspec-wire/1 protocol (docs/protocol.md),
//! for `mhaspec run "exec:PROGRAM ARGS…"`.  Start from it to validate your own kernel:
//! keep `src/protocol/` (frames, JSON, safetensors, the case, the replies) and replace
//! `src/attention.rs` (`attention::forward`: a checked `Case` in, eight `Stage`s out) with a
//! call into your kernel.
//!
//! Build (no dependencies; no crate registry needed), from the repository root:
//!
//!     cargo build --release --offline --manifest-path examples/exec/rust/Cargo.toml
//!
//! Run under mhaspec (it starts the program and speaks the protocol with it):
//!
//!     mhaspec run "exec:examples/exec/rust/target/release/mha_rust"
//!     mhaspec run "exec:examples/exec/rust/target/release/mha_rust --bug causal-diagonal"
//!
//! `--bug causal-diagonal` plants one bug: the causal rule excludes the diagonal (j < i + off
//! instead of j <= i + off), so causal cases fail, first at `attn_weights`; the name in
//! `ready` becomes `rust-mha[bug:causal-diagonal]`.  Without it the program is correct.
//!
//! The convention of `exec:`: the environment variable MHASPEC_WIRE_FDS = "READ_FD,WRITE_FD"
//! names the inherited pipes; the program sends `ready` first, then answers each request
//! with one frame until `close` or end of file.  stdout and stderr are the user's: nothing
//! of the protocol is ever written there.

// `x % n != 0` rather than `!x.is_multiple_of(n)`: the program builds with Rust older than 1.87.
#![allow(unknown_lints, clippy::manual_is_multiple_of)]

mod attention;
mod dtypes;
mod protocol;

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::os::unix::io::FromRawFd;
use std::time::Instant;

use attention::Bug;
use protocol::case::Case;
use protocol::frame;
use protocol::json::Json;

const NAME: &str = "rust-mha";

fn usage_error(msg: &str) -> ! {
    eprintln!("mha_rust: {msg} (usage: mha_rust [--bug {}])", Bug::NAMES.join("|"));
    std::process::exit(2);
}

fn parse_args() -> Option<Bug> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = match args.as_slice() {
        [] => return None,
        [flag, name] if flag == "--bug" => name.as_str(),
        [one] if one.starts_with("--bug=") => &one["--bug=".len()..],
        _ => usage_error(&format!("unexpected arguments {args:?}")),
    };
    Some(Bug::from_name(name).unwrap_or_else(|| usage_error(&format!("unknown bug '{name}'"))))
}

/// The two descriptors of MHASPEC_WIRE_FDS, as files (exit 2 if missing, malformed or not open).
fn wire_files() -> (File, File) {
    let fail = |why: String| -> ! {
        eprintln!("mha_rust: {why}; this program is started by mhaspec: mhaspec run \"exec:PATH/TO/mha_rust\"");
        std::process::exit(2);
    };
    let value = std::env::var("MHASPEC_WIRE_FDS").unwrap_or_else(|_| fail("MHASPEC_WIRE_FDS is not set".into()));
    let fds: Vec<i32> = value.split(',').map(|p| p.trim().parse::<i32>().unwrap_or(-1)).collect();
    let (rfd, wfd) = match fds.as_slice() {
        [r, w] if *r >= 0 && *w >= 0 => (*r, *w),
        _ => fail(format!("MHASPEC_WIRE_FDS = {value:?} is not READ_FD,WRITE_FD")),
    };
    // SAFETY: the runner hands these descriptors to this process for it alone; nothing
    // else in the program opens or closes them.
    let reader = unsafe { File::from_raw_fd(rfd) };
    if reader.metadata().is_err() {
        std::mem::forget(reader);
        fail(format!("MHASPEC_WIRE_FDS: descriptor {rfd} is not open"));
    }
    let writer = if wfd == rfd {
        reader.try_clone().unwrap_or_else(|e| fail(format!("MHASPEC_WIRE_FDS: {e}")))
    } else {
        let w = unsafe { File::from_raw_fd(wfd) };
        if w.metadata().is_err() {
            std::mem::forget(w);
            fail(format!("MHASPEC_WIRE_FDS: descriptor {wfd} is not open"));
        }
        w
    };
    (reader, writer)
}

fn environment(bug: Option<Bug>) -> Json {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    Json::obj(vec![
        ("process", Json::str("exec")),
        ("language", Json::str("Rust")),
        ("compiler", Json::str(env!("MHA_RUST_RUSTC_VERSION"))),
        ("program", Json::Str(format!("{} {}", env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION")))),
        ("target", Json::Str(format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS))),
        ("profile", Json::str(if cfg!(debug_assertions) { "debug" } else { "release" })),
        ("threads", Json::int(threads as u64)),
        ("bug", bug.map_or(Json::Null, |b| Json::str(b.name()))),
    ])
}

fn main() {
    let bug = parse_args();
    let (reader, writer) = wire_files();
    let code = match serve(reader, writer, bug) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("mha_rust: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// The session (docs/protocol.md §3): `ready`, then one reply per request.
fn serve(reader: File, writer: File, bug: Option<Bug>) -> Result<(), String> {
    let mut r = BufReader::with_capacity(1 << 16, reader);
    let mut w = BufWriter::with_capacity(1 << 20, writer);
    let io = |e: std::io::Error| format!("writing the reply stream: {e}");

    let name = match bug {
        None => NAME.to_string(),
        Some(b) => format!("{NAME}[bug:{}]", b.name()),
    };
    frame::write_header_only(&mut w, &protocol::ready(&name, environment(bug))).map_err(io)?;

    // The last case sent (or why it could not be read), for requests with "reuse": true.
    let mut last: Option<Result<Case, String>> = None;
    while let Some(req) = frame::read_frame(&mut r)? {
        let op = req.header.get("op").and_then(Json::as_str).unwrap_or("");
        protocol::answering(req.header.get("seq").and_then(Json::as_u64));
        let step = op.split('+').next().unwrap_or("");
        if op == "close" {
            return Ok(());
        }
        if !matches!(op, "run" | "supports" | "backward" | "supports+run" | "supports+backward") {
            let msg = format!("unknown request op {:?} (this worker answers run and close)", op);
            frame::write_header_only(&mut w, &protocol::failure("run", &msg)).map_err(io)?;
            continue;
        }

        if req.header.get("reuse").and_then(Json::as_bool) == Some(true) {
            if last.is_none() {
                last = Some(Err("a reuse request before any case".into()));
            }
        } else if let Some(c) = req.header.get("case") {
            drop(last.take()); // free the previous case first
            last = Some(Case::from_request(c, req.payload));
        } else {
            last = Some(Err(format!("a '{op}' request with neither case nor reuse")));
        }

        if step != "run" {
            let msg = format!("this worker announced has_supports=false and has_backward=false; it does not answer '{op}'");
            frame::write_header_only(&mut w, &protocol::failure(step, &msg)).map_err(io)?;
            continue;
        }
        match last.as_ref().unwrap() {
            Err(e) => frame::write_header_only(&mut w, &protocol::failure("run", e)).map_err(io)?,
            Ok(case) => {
                let start = Instant::now();
                let stages = attention::forward(case, bug);
                let seconds = start.elapsed().as_secs_f64();
                protocol::write_run_reply(&mut w, &stages, case.dtype, seconds).map_err(io)?;
            }
        }
        w.flush().map_err(io)?;
    }
    Ok(())
}
