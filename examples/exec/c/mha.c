/*
 * mha.c -- a reference worker program for mhaspec, in C: a complete multi-head
 * attention (MHA) that speaks the wire protocol mhaspec-wire/1 (docs/protocol.md)
 * and conforms on the whole catalog in float64, float32, float16 and bfloat16.
 *
 * Build (C11, libc and libm only):
 *     gcc -O2 -std=c11 -Wall -Wextra -o mha_c mha.c -lm
 *
 * Run it under mhaspec (the runner starts the program and passes two pipe
 * descriptors in MHASPEC_WIRE_FDS=READ_FD,WRITE_FD):
 *     mhaspec run "exec:./mha_c"                     all 28 cases pass, every dtype
 *     mhaspec run "exec:./mha_c" --dtype float16 -k gqa
 *     mhaspec run "exec:./mha_c --bug no-scale"      a buggy twin: the scores lack
 *                                                    the scale (first failing stage:
 *                                                    scores); its name is
 *                                                    c-mha[bug:no-scale]
 *
 * The file has two halves:
 *   PROTOCOL  (sections 1-4): numbers (float16/bfloat16 rounding), frames, a small
 *             JSON reader and writer, a safetensors reader and writer, and the case
 *             a request describes (struct mha_case). Keep it as it is.
 *   ATTENTION (section 5): mha_forward(), which fills the eight stages. To validate
 *             your own kernel, replace the body of mha_forward() with a call into it:
 *             it gets the sizes, the case's dtype and the float64 inputs and weights,
 *             and writes each stage, in the case's dtype, C order, into the buffers
 *             it is given (they already are the reply's safetensors payload).
 *   Section 6 is the serving loop: ready, then one reply per request.
 *
 * The computation reproduces mhaspec's numpy adapter (src/mhaspec/adapters/
 * numpy_mha.py): every stage is stored in the case's dtype, each product sum is
 * accumulated in float for float32, float16 and bfloat16 (in double for float64),
 * and float16/bfloat16 are rounded to nearest, ties to even.
 *
 * The program never writes protocol bytes to stdout or stderr; diagnostics go to
 * stderr. Exit status: 0 after close or end of file on the request pipe, 1 when the
 * pipes break or carry something that is not a frame, 2 on bad usage.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PROGRAM_NAME "c-mha"
#define PROTOCOL "mhaspec-wire/1"

/* --bug no-scale: the planted bug of the buggy twin (0: the correct program). */
static int bug_no_scale = 0;

/* ===================================================================== */
/* 1. Numbers: the dtypes, float16 / bfloat16 rounding                    */
/* ===================================================================== */

typedef enum { DT_F64, DT_F32, DT_F16, DT_BF16 } dtype_t;

static const char *const DT_NAME[] = {"float64", "float32", "float16", "bfloat16"};
static const char *const DT_CODE[] = {"F64", "F32", "F16", "BF16"};
static const size_t DT_SIZE[] = {8, 4, 2, 2};

static float bits_to_float(uint32_t x) { float f; memcpy(&f, &x, 4); return f; }
static uint32_t float_to_bits(float f) { uint32_t x; memcpy(&x, &f, 4); return x; }

/* float -> IEEE binary16, round to nearest, ties to even (subnormals, overflow to inf, NaN). */
static uint16_t f16_from_float(float f) {
    uint32_t x = float_to_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff)); /* NaN, quiet */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* >= 65520: inf (and inf) */
    if (a >= 0x38800000u) {                                  /* >= 2^-14: a normal float16 */
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u);          /* round the 13 dropped bits */
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13)); /* rebias 127 -> 15 */
    }
    uint32_t e = a >> 23; /* a float16 subnormal: units of 2^-24 */
    if (e < 102) return sign; /* below 2^-25 (float subnormals, zero): rounds to 0 */
    uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e; /* 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++; /* q = 1024 is the smallest normal */
    return (uint16_t)(sign | q);
}

/* double -> binary16, one correct rounding (used for the float64 inputs and weights). */
static uint16_t f16_from_double(double d) {
    uint16_t sign = signbit(d) ? 0x8000 : 0;
    double a = fabs(d);
    if (isnan(d)) return (uint16_t)(sign | 0x7e00);
    if (a < 0x1p-14) return (uint16_t)(sign | (uint16_t)rint(a * 0x1p24)); /* subnormal */
    if (a >= 65520.0) return (uint16_t)(sign | 0x7c00);
    int e;
    frexp(a, &e);                                /* a in [2^(e-1), 2^e) */
    int m = (int)rint(ldexp(a, 11 - e));         /* [1024, 2048]: a carry is fine */
    return (uint16_t)(sign | (((e - 1 + 15) << 10) + m - 1024));
}

/* float -> bfloat16 (the upper half of the binary32), round to nearest, ties to even. */
static uint16_t bf16_from_float(float f) {
    uint32_t x = float_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* NaN, quiet */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* double -> bfloat16, one correct rounding. */
static uint16_t bf16_from_double(double d) {
    uint16_t sign = signbit(d) ? 0x8000 : 0;
    double a = fabs(d);
    if (isnan(d)) return (uint16_t)(sign | 0x7fc0);
    if (a < 0x1p-126) return (uint16_t)(sign | (uint16_t)rint(a * 0x1p133)); /* subnormal */
    if (a >= 0x1.ffp127) return (uint16_t)(sign | 0x7f80);
    int e;
    frexp(a, &e);
    int m = (int)rint(ldexp(a, 8 - e)); /* [128, 256] */
    return (uint16_t)(sign | (((e - 1 + 127) << 7) + m - 128));
}

static float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static float f16_decode(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return bits_to_float(sign | 0x7f800000u | (m << 13));
    if (e != 0) return bits_to_float(sign | ((e + 112) << 23) | (m << 13));
    float f = (float)m * 0x1p-24f; /* zero or subnormal: exact */
    return sign ? -f : f;
}

static float F16_TO_FLOAT[65536]; /* filled by main() */

static float f16_to_float(uint16_t h) { return F16_TO_FLOAT[h]; }

/* x rounded to the dtype dt (as a double, exactly). */
static double round_to(dtype_t dt, double x) {
    switch (dt) {
    case DT_F32: return (double)(float)x;
    case DT_F16: return (double)f16_to_float(f16_from_double(x));
    case DT_BF16: return (double)bf16_to_float(bf16_from_double(x));
    default: return x;
    }
}

/* A float64 of a payload (little-endian, possibly unaligned). */
static double rd_f64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    double d;
    memcpy(&d, &v, 8);
    return d;
}

/* ===================================================================== */
/* 2. Frames (docs/protocol.md section 2)                                 */
/* ===================================================================== */

#define MAX_HEADER ((uint64_t)1 << 24)
#define MAX_PAYLOAD ((uint64_t)1 << 40)

/* 0: read n bytes; 1: end of file before the first byte; -1: end of file later, or an error. */
static int read_exact(int fd, void *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t k = read(fd, (char *)buf + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return got == 0 && k == 0 ? 1 : -1;
        got += (size_t)k;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
    for (size_t put = 0; put < n;) {
        ssize_t k = write(fd, (const char *)buf + put, n - put);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        put += (size_t)k;
    }
    return 0;
}

static uint64_t le64(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static void put_le64(unsigned char *b, uint64_t v) {
    for (int i = 0; i < 8; i++, v >>= 8) b[i] = (unsigned char)(v & 0xff);
}

static int write_frame(int fd, const char *header, size_t h, const unsigned char *payload, uint64_t p) {
    unsigned char head[16];
    put_le64(head, h);
    put_le64(head + 8, p);
    return write_all(fd, head, 16) || write_all(fd, header, h) || (p && write_all(fd, payload, (size_t)p));
}

/* Read and drop n bytes. */
static int skip_bytes(int fd, uint64_t n) {
    static unsigned char sink[1 << 16];
    while (n) {
        size_t k = n < sizeof sink ? (size_t)n : sizeof sink;
        if (read_exact(fd, sink, k)) return -1;
        n -= k;
    }
    return 0;
}

/* ===================================================================== */
/* 3. JSON: a small reader (a tree) and a string builder                  */
/* ===================================================================== */

typedef enum { J_NULL, J_FALSE, J_TRUE, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype type;
    double num;            /* J_NUM */
    int is_int;            /* J_NUM written as an integer that fits in long long */
    long long inum;
    char *str;             /* J_STR: UTF-8, NUL-terminated (len excludes the NUL) */
    size_t len;
    size_t n;              /* J_ARR, J_OBJ: the items (and, in an object, their keys) */
    struct jval *items;
    struct jval *keys;
} jval;

typedef struct {
    const char *start, *p, *end;
    char err[160];
} jparser;

static int jfail(jparser *s, const char *msg) {
    if (!s->err[0]) snprintf(s->err, sizeof s->err, "%s at byte %ld", msg, (long)(s->p - s->start));
    return -1;
}

static void jws(jparser *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static void jfree(jval *v) {
    if (v->type == J_STR) free(v->str);
    if (v->type == J_ARR || v->type == J_OBJ) {
        for (size_t i = 0; i < v->n; i++) {
            jfree(&v->items[i]);
            if (v->keys) jfree(&v->keys[i]);
        }
        free(v->items);
        free(v->keys);
    }
    memset(v, 0, sizeof *v);
}

static int jhex4(jparser *s, unsigned *out) {
    if (s->end - s->p < 4) return jfail(s, "short \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = *s->p++;
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return jfail(s, "bad \\u escape");
    }
    *out = v;
    return 0;
}

static int jstring(jparser *s, jval *out) {
    size_t cap = 32, n = 0;
    char *buf = malloc(cap);
    if (!buf) return jfail(s, "out of memory");
    s->p++; /* the opening quote */
    for (;;) {
        if (n + 5 > cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) { free(buf); return jfail(s, "out of memory"); }
            buf = nb;
        }
        if (s->p >= s->end) { free(buf); return jfail(s, "unterminated string"); }
        unsigned char c = (unsigned char)*s->p++;
        if (c == '"') break;
        if (c < 0x20) { free(buf); return jfail(s, "control character in a string"); }
        if (c != '\\') { buf[n++] = (char)c; continue; }
        if (s->p >= s->end) { free(buf); return jfail(s, "unterminated string"); }
        char e = *s->p++;
        switch (e) {
        case '"': case '\\': case '/': buf[n++] = e; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (jhex4(s, &cp)) { free(buf); return -1; }
            if (cp >= 0xD800 && cp < 0xDC00 && s->end - s->p >= 6 && s->p[0] == '\\' && s->p[1] == 'u') {
                const char *back = s->p;
                s->p += 2;
                if (jhex4(s, &lo)) { free(buf); return -1; }
                if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else s->p = back; /* a lone surrogate, kept as is */
            }
            if (cp < 0x80) buf[n++] = (char)cp;
            else if (cp < 0x800) {
                buf[n++] = (char)(0xC0 | (cp >> 6));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                buf[n++] = (char)(0xE0 | (cp >> 12));
                buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            } else {
                buf[n++] = (char)(0xF0 | (cp >> 18));
                buf[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: free(buf); return jfail(s, "bad escape in a string");
        }
    }
    buf[n] = '\0';
    out->type = J_STR;
    out->str = buf;
    out->len = n;
    return 0;
}

static int isdig(char c) { return c >= '0' && c <= '9'; }

static int jnumber(jparser *s, jval *out) {
    const char *q = s->p;
    int is_int = 1;
    if (q < s->end && *q == '-') q++;
    if (q < s->end && *q == '0') q++;
    else if (q < s->end && isdig(*q)) while (q < s->end && isdig(*q)) q++;
    else return jfail(s, "bad number");
    if (q < s->end && *q == '.') {
        is_int = 0;
        if (++q >= s->end || !isdig(*q)) return jfail(s, "bad number");
        while (q < s->end && isdig(*q)) q++;
    }
    if (q < s->end && (*q == 'e' || *q == 'E')) {
        is_int = 0;
        q++;
        if (q < s->end && (*q == '+' || *q == '-')) q++;
        if (q >= s->end || !isdig(*q)) return jfail(s, "bad number");
        while (q < s->end && isdig(*q)) q++;
    }
    size_t len = (size_t)(q - s->p);
    char small[64], *text = len < sizeof small ? small : malloc(len + 1);
    if (!text) return jfail(s, "out of memory");
    memcpy(text, s->p, len);
    text[len] = '\0';
    out->type = J_NUM;
    out->num = strtod(text, NULL);
    out->is_int = 0;
    if (is_int) {
        errno = 0;
        out->inum = strtoll(text, NULL, 10);
        out->is_int = errno != ERANGE;
    }
    if (text != small) free(text);
    s->p = q;
    return 0;
}

static int jvalue(jparser *s, jval *out, int depth);

static int jcontainer(jparser *s, jval *out, int depth, int is_obj) {
    char close = is_obj ? '}' : ']';
    size_t cap = 0;
    out->type = is_obj ? J_OBJ : J_ARR;
    s->p++;
    jws(s);
    if (s->p < s->end && *s->p == close) { s->p++; return 0; }
    for (;;) {
        if (out->n == cap) {
            cap = cap ? cap * 2 : 8;
            jval *ni = realloc(out->items, cap * sizeof *ni);
            if (!ni) return jfail(s, "out of memory");
            out->items = ni;
            if (is_obj) {
                jval *nk = realloc(out->keys, cap * sizeof *nk);
                if (!nk) return jfail(s, "out of memory");
                out->keys = nk;
            }
        }
        jval *item = &out->items[out->n], *key = is_obj ? &out->keys[out->n] : NULL;
        memset(item, 0, sizeof *item);
        if (key) memset(key, 0, sizeof *key);
        if (is_obj) {
            jws(s);
            if (s->p >= s->end || *s->p != '"') return jfail(s, "expected a key");
            out->n++; /* counted now, so that jfree frees a half-read item */
            if (jstring(s, key)) return -1;
            jws(s);
            if (s->p >= s->end || *s->p != ':') return jfail(s, "expected ':'");
            s->p++;
        } else {
            out->n++;
        }
        if (jvalue(s, item, depth + 1)) return -1;
        jws(s);
        if (s->p < s->end && *s->p == ',') { s->p++; continue; }
        if (s->p < s->end && *s->p == close) { s->p++; return 0; }
        return jfail(s, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int jlit(jparser *s, const char *word, jtype t, jval *out) {
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n)) return jfail(s, "unexpected character");
    s->p += n;
    out->type = t;
    return 0;
}

static int jvalue(jparser *s, jval *out, int depth) {
    if (depth > 64) return jfail(s, "nested too deep");
    jws(s);
    if (s->p >= s->end) return jfail(s, "unexpected end");
    switch (*s->p) {
    case '{': return jcontainer(s, out, depth, 1);
    case '[': return jcontainer(s, out, depth, 0);
    case '"': return jstring(s, out);
    case 't': return jlit(s, "true", J_TRUE, out);
    case 'f': return jlit(s, "false", J_FALSE, out);
    case 'n': return jlit(s, "null", J_NULL, out);
    default: return jnumber(s, out);
    }
}

/* Parse text[0..n) as one JSON value; 0 ok, else -1 with err filled. */
static int jparse(const char *text, size_t n, jval *out, char *err, size_t errlen) {
    jparser s = {text, text, text + n, ""};
    memset(out, 0, sizeof *out);
    int r = jvalue(&s, out, 0);
    if (!r) {
        jws(&s);
        if (s.p != s.end) r = jfail(&s, "trailing characters");
    }
    if (r) {
        snprintf(err, errlen, "%s", s.err);
        jfree(out);
    }
    return r;
}

static int jkey_is(const jval *key, const char *name) {
    return key->len == strlen(name) && memcmp(key->str, name, key->len) == 0;
}

/* obj[name], or NULL (also when obj is not an object). */
static const jval *jget(const jval *obj, const char *name) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (size_t i = 0; i < obj->n; i++)
        if (jkey_is(&obj->keys[i], name)) return &obj->items[i];
    return NULL;
}

static int jis_str(const jval *v, const char *s) {
    return v && v->type == J_STR && v->len == strlen(s) && memcmp(v->str, s, v->len) == 0;
}

/* A name from the other side, made printable for a one-line message. */
static const char *printable(const char *s, size_t n, char *buf, size_t cap) {
    size_t k = 0, i = 0;
    for (; i < n && k + 4 < cap; i++) buf[k++] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (i < n) { memcpy(buf + k, "...", 3); k += 3; } /* cut short */
    buf[k] = '\0';
    return buf;
}

/* A growing string. */
typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) { b->oom = 1; return; }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k > 0) sb_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* A JSON string literal; bytes that are not printable ASCII become '?' (messages stay one line). */
static void sb_json_string(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { char e[2] = {'\\', (char)c}; sb_put(b, e, 2); }
        else if (c < 0x20 || c >= 0x7f) sb_put(b, "?", 1);
        else sb_put(b, (const char *)&c, 1);
    }
    sb_put(b, "\"", 1);
}

/* ===================================================================== */
/* 4. Safetensors, and the case a request describes                       */
/* ===================================================================== */

typedef struct {
    const char *name;          /* points into the parsed header */
    char code[16];             /* the dtype code as written ("F64", "BOOL", ...) */
    int rank;
    int64_t shape[8];
    const unsigned char *data; /* into the payload */
    uint64_t nbytes;
} st_tensor;

typedef struct {
    jval header;
    size_t n;
    st_tensor *t;
} st_file;

static size_t st_code_size(const char *code) {
    static const char *const codes[] = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "BOOL", "I8",
                                        "I16", "I32", "I64", "U8", "U16", "U32", "U64"};
    static const size_t sizes[] = {8, 4, 2, 2, 1, 1, 1, 1, 2, 4, 8, 1, 2, 4, 8};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        if (!strcmp(code, codes[i])) return sizes[i];
    return 0;
}

static void st_free(st_file *f) {
    jfree(&f->header);
    free(f->t);
    memset(f, 0, sizeof *f);
}

/* Read the safetensors bytes buf[0..len): tensors in any order, found by data_offsets. */
static int st_read(const unsigned char *buf, uint64_t len, st_file *f, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    if (len < 8) { snprintf(err, errlen, "the payload is %llu bytes, not safetensors", (unsigned long long)len); return -1; }
    uint64_t n = le64(buf);
    if (n > len - 8) { snprintf(err, errlen, "the payload's safetensors header (%llu bytes) runs past its end", (unsigned long long)n); return -1; }
    char jerr[200];
    if (jparse((const char *)buf + 8, (size_t)n, &f->header, jerr, sizeof jerr)) {
        snprintf(err, errlen, "the payload's safetensors header is not JSON: %s", jerr);
        return -1;
    }
    if (f->header.type != J_OBJ) { snprintf(err, errlen, "the payload's safetensors header is not a JSON object"); st_free(f); return -1; }
    const unsigned char *data = buf + 8 + n;
    uint64_t data_len = len - 8 - n;
    f->t = calloc(f->header.n ? f->header.n : 1, sizeof *f->t);
    if (!f->t) { snprintf(err, errlen, "out of memory"); st_free(f); return -1; }
    for (size_t i = 0; i < f->header.n; i++) {
        const jval *key = &f->header.keys[i], *v = &f->header.items[i];
        char nm[64];
        if (jkey_is(key, "__metadata__")) continue;
        printable(key->str, key->len, nm, sizeof nm);
        const jval *dt = jget(v, "dtype"), *shape = jget(v, "shape"), *offs = jget(v, "data_offsets");
        if (!dt || dt->type != J_STR || !shape || shape->type != J_ARR || shape->n > 8 || !offs || offs->type != J_ARR || offs->n != 2) {
            snprintf(err, errlen, "payload tensor %s: no dtype, shape (at most 8 dimensions) or data_offsets", nm);
            st_free(f);
            return -1;
        }
        st_tensor *t = &f->t[f->n];
        t->name = key->str;
        snprintf(t->code, sizeof t->code, "%s", dt->str);
        t->rank = (int)shape->n;
        uint64_t count = 1;
        for (size_t d = 0; d < shape->n; d++) {
            const jval *s = &shape->items[d];
            if (s->type != J_NUM || !s->is_int || s->inum < 0 || s->inum > (1LL << 40)) {
                snprintf(err, errlen, "payload tensor %s: a bad shape", nm);
                st_free(f);
                return -1;
            }
            t->shape[d] = s->inum;
            count = (count > 0 && (uint64_t)s->inum > (MAX_PAYLOAD / count)) ? MAX_PAYLOAD + 1 : count * (uint64_t)s->inum;
        }
        const jval *a = &offs->items[0], *b = &offs->items[1];
        if (a->type != J_NUM || b->type != J_NUM || !a->is_int || !b->is_int || a->inum < 0 || b->inum < a->inum ||
            (uint64_t)b->inum > data_len) {
            snprintf(err, errlen, "payload tensor %s: data_offsets outside the payload", nm);
            st_free(f);
            return -1;
        }
        t->data = data + a->inum;
        t->nbytes = (uint64_t)(b->inum - a->inum);
        size_t item = st_code_size(t->code);
        if (item && count * item != t->nbytes) {
            snprintf(err, errlen, "payload tensor %s: %llu bytes for its shape and dtype %s", nm,
                     (unsigned long long)t->nbytes, t->code);
            st_free(f);
            return -1;
        }
        f->n++;
    }
    return 0;
}

static const st_tensor *st_find(const st_file *f, const char *name) {
    for (size_t i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return &f->t[i];
    return NULL;
}

/* The eight forward stages, in pipeline order (docs/spec.md section 2). */
enum { Q_PROJ, K_PROJ, V_PROJ, SCORES, ATTN_WEIGHTS, HEAD_OUTPUTS, CONCAT, OUTPUT, N_STAGES };
static const char *const STAGE_NAME[N_STAGES] = {"q_proj", "k_proj", "v_proj", "scores",
                                                 "attn_weights", "head_outputs", "concat", "output"};

/* One case: sizes, config, and the float64 arrays of the request payload (C order,
 * little-endian, possibly unaligned: read them with rd_f64). */
typedef struct {
    char id[128];
    dtype_t dt;
    size_t B, T, S;                      /* batch, tgt_len, src_len */
    size_t d_model, kdim, vdim, H, H_kv, D_k, D_v, d_out;
    int bias, causal, bottom_right;      /* bottom_right: causal_alignment == "bottom_right" */
    double scale;
    const unsigned char *query, *key, *value;   /* (B,T,d_model), (B,S,kdim), (B,S,vdim) */
    const unsigned char *w_q, *w_k, *w_v, *w_o; /* (in, out): y = x . W + b */
    const unsigned char *b_q, *b_k, *b_v, *b_o; /* NULL without bias */
    const unsigned char *mask;           /* BOOL, true = may attend; NULL: none */
    size_t mask_stride[4];               /* its element strides over (B, H, T, S); 0 broadcasts */
} mha_case;

static const char *const KNOWN_CONFIG[] = {"d_model", "num_heads", "kdim", "vdim", "num_kv_heads", "head_dim",
                                           "value_head_dim", "out_dim", "bias", "scale", "causal",
                                           "causal_alignment"};

static int get_size(const jval *obj, const char *where, const char *name, size_t *out, char *err, size_t errlen) {
    const jval *v = jget(obj, name);
    if (!v || v->type != J_NUM || !v->is_int || v->inum < 1 || v->inum > (1LL << 40)) {
        snprintf(err, errlen, "%s.%s is %s", where, name, v ? "not a positive integer" : "missing");
        return -1;
    }
    *out = (size_t)v->inum;
    return 0;
}

static int get_bool(const jval *obj, const char *name, int *out, char *err, size_t errlen) {
    const jval *v = jget(obj, name);
    if (!v || (v->type != J_TRUE && v->type != J_FALSE)) {
        snprintf(err, errlen, "config.%s is %s", name, v ? "not true or false" : "missing");
        return -1;
    }
    *out = v->type == J_TRUE;
    return 0;
}

/* A float64 array of the payload with the given shape: its bytes, or NULL with err filled. */
static const unsigned char *get_array(const st_file *f, const char *name, int rank, const size_t *shape, int required,
                                      char *err, size_t errlen) {
    const st_tensor *t = st_find(f, name);
    if (!t) {
        if (required) snprintf(err, errlen, "missing array %s", name);
        return NULL;
    }
    int ok = !strcmp(t->code, "F64") && t->rank == rank;
    for (int d = 0; ok && d < rank; d++) ok = (size_t)t->shape[d] == shape[d];
    if (!ok) {
        char want[128] = "(", got[128] = "(";
        for (int d = 0; d < rank; d++) snprintf(want + strlen(want), sizeof want - strlen(want), "%s%zu", d ? ", " : "", shape[d]);
        for (int d = 0; d < t->rank; d++) snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        snprintf(err, errlen, "array %s is %s %s), not F64 %s)", name, t->code, got, want);
        return NULL;
    }
    return t->data;
}

/* Build the case from a request's "case" object and its safetensors payload. */
static int read_case(const jval *cj, const unsigned char *payload, uint64_t plen, mha_case *c, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    const jval *sc = jget(cj, "scalars"), *cfg = jget(cj, "config"), *al = jget(cj, "aliases");
    if (!sc || sc->type != J_OBJ || !cfg || cfg->type != J_OBJ) {
        snprintf(err, errlen, "the case has no scalars or config object");
        return -1;
    }
    char nm[64];
    const jval *id = jget(sc, "id"), *dt = jget(sc, "dtype");
    if (id && id->type == J_STR) printable(id->str, id->len, c->id, sizeof c->id);
    if (!dt || dt->type != J_STR) { snprintf(err, errlen, "case.scalars.dtype is missing"); return -1; }
    int found = 0;
    for (int i = 0; i < 4; i++)
        if (jis_str(dt, DT_NAME[i])) { c->dt = (dtype_t)i; found = 1; }
    if (!found) {
        snprintf(err, errlen, "unknown dtype '%s'", printable(dt->str, dt->len, nm, sizeof nm));
        return -1;
    }
    if (get_size(sc, "scalars", "batch", &c->B, err, errlen) || get_size(sc, "scalars", "tgt_len", &c->T, err, errlen) ||
        get_size(sc, "scalars", "src_len", &c->S, err, errlen))
        return -1;

    /* docs/protocol.md section 7: a config field we do not know, set to anything but its
     * default (null, false, 0), must not be computed as if it were absent. */
    for (size_t i = 0; i < cfg->n; i++) {
        int known = 0;
        for (size_t k = 0; k < sizeof KNOWN_CONFIG / sizeof *KNOWN_CONFIG; k++) known |= jkey_is(&cfg->keys[i], KNOWN_CONFIG[k]);
        const jval *v = &cfg->items[i];
        int is_default = v->type == J_NULL || v->type == J_FALSE || (v->type == J_NUM && v->num == 0);
        if (!known && !is_default) {
            snprintf(err, errlen, "config.%s is set, a field " PROGRAM_NAME " does not know (docs/protocol.md section 7)",
                     printable(cfg->keys[i].str, cfg->keys[i].len, nm, sizeof nm));
            return -1;
        }
    }
    if (get_size(cfg, "config", "d_model", &c->d_model, err, errlen) || get_size(cfg, "config", "num_heads", &c->H, err, errlen) ||
        get_size(cfg, "config", "kdim", &c->kdim, err, errlen) || get_size(cfg, "config", "vdim", &c->vdim, err, errlen) ||
        get_size(cfg, "config", "num_kv_heads", &c->H_kv, err, errlen) ||
        get_size(cfg, "config", "head_dim", &c->D_k, err, errlen) ||
        get_size(cfg, "config", "value_head_dim", &c->D_v, err, errlen) ||
        get_size(cfg, "config", "out_dim", &c->d_out, err, errlen) || get_bool(cfg, "bias", &c->bias, err, errlen) ||
        get_bool(cfg, "causal", &c->causal, err, errlen))
        return -1;
    const jval *scale = jget(cfg, "scale"), *align = jget(cfg, "causal_alignment");
    if (!scale || scale->type != J_NUM || !(scale->num > 0) || !isfinite(scale->num)) {
        snprintf(err, errlen, "config.scale is %s", scale ? "not a positive number" : "missing");
        return -1;
    }
    c->scale = scale->num;
    if (jis_str(align, "bottom_right")) c->bottom_right = 1;
    else if (!jis_str(align, "top_left")) {
        snprintf(err, errlen, "config.causal_alignment is not 'top_left' or 'bottom_right'");
        return -1;
    }
    if (c->H % c->H_kv) {
        snprintf(err, errlen, "config.num_heads (%zu) is not a multiple of num_kv_heads (%zu)", c->H, c->H_kv);
        return -1;
    }

    /* The arrays. An alias names the input whose array this one is (it is not in the payload). */
    st_file f;
    if (st_read(payload, plen, &f, err, errlen)) return -1;
    static const char *const INPUTS[] = {"query", "key", "value", "mask"};
    char tensor_name[4][64];
    for (int i = 0; i < 4; i++) {
        const char *name = INPUTS[i];
        for (int hop = 0; hop < 4; hop++) {
            const jval *to = jget(al, name);
            if (!to || to->type != J_STR) break;
            int k;
            for (k = 0; k < 4 && !jis_str(to, INPUTS[k]); k++) {}
            if (k == 4) {
                snprintf(err, errlen, "case.aliases.%s names no input", INPUTS[i]);
                st_free(&f);
                return -1;
            }
            name = INPUTS[k];
        }
        snprintf(tensor_name[i], sizeof tensor_name[i], "input.%s", name);
    }
    const size_t B = c->B, T = c->T, S = c->S;
    int r = -1;
    if (!(c->query = get_array(&f, tensor_name[0], 3, (size_t[]){B, T, c->d_model}, 1, err, errlen))) goto done;
    if (!(c->key = get_array(&f, tensor_name[1], 3, (size_t[]){B, S, c->kdim}, 1, err, errlen))) goto done;
    if (!(c->value = get_array(&f, tensor_name[2], 3, (size_t[]){B, S, c->vdim}, 1, err, errlen))) goto done;
    if (!(c->w_q = get_array(&f, "weight.w_q", 2, (size_t[]){c->d_model, c->H * c->D_k}, 1, err, errlen))) goto done;
    if (!(c->w_k = get_array(&f, "weight.w_k", 2, (size_t[]){c->kdim, c->H_kv * c->D_k}, 1, err, errlen))) goto done;
    if (!(c->w_v = get_array(&f, "weight.w_v", 2, (size_t[]){c->vdim, c->H_kv * c->D_v}, 1, err, errlen))) goto done;
    if (!(c->w_o = get_array(&f, "weight.w_o", 2, (size_t[]){c->H * c->D_v, c->d_out}, 1, err, errlen))) goto done;
    if (c->bias) {
        if (!(c->b_q = get_array(&f, "weight.b_q", 1, (size_t[]){c->H * c->D_k}, 1, err, errlen))) goto done;
        if (!(c->b_k = get_array(&f, "weight.b_k", 1, (size_t[]){c->H_kv * c->D_k}, 1, err, errlen))) goto done;
        if (!(c->b_v = get_array(&f, "weight.b_v", 1, (size_t[]){c->H_kv * c->D_v}, 1, err, errlen))) goto done;
        if (!(c->b_o = get_array(&f, "weight.b_o", 1, (size_t[]){c->d_out}, 1, err, errlen))) goto done;
    }
    const st_tensor *m = st_find(&f, tensor_name[3]);
    if (m) { /* BOOL, broadcastable to (B, H, T, S): (B,1,1,S) or (B,1,T,S) in the catalog */
        const size_t full[4] = {B, c->H, T, S};
        int ok = !strcmp(m->code, "BOOL") && m->rank >= 1 && m->rank <= 4;
        size_t stride = 1;
        for (int d = 3; ok && d >= 0; d--) {
            int md = d - (4 - m->rank); /* the mask's own dimension, aligned to the right */
            size_t extent = md >= 0 ? (size_t)m->shape[md] : 1;
            ok = extent == 1 || extent == full[d];
            c->mask_stride[d] = extent == 1 ? 0 : stride;
            stride *= extent;
        }
        if (!ok) {
            snprintf(err, errlen, "array %s is not a BOOL array broadcastable to (B, H, T, S)", tensor_name[3]);
            goto done;
        }
        c->mask = m->data;
    }
    r = 0;
done:
    st_free(&f);
    return r;
}

/* ===================================================================== */
/* 5. ATTENTION: the forward pass (replace mha_forward with your kernel)  */
/* ===================================================================== */

/* visible[j] for query row i of batch b, head h: the causal rule AND the mask. */
static void visible_row(const mha_case *c, size_t b, size_t h, size_t i, unsigned char *visible) {
    long long last = (long long)i + (c->bottom_right ? (long long)c->S - (long long)c->T : 0);
    const unsigned char *mrow = c->mask ? c->mask + b * c->mask_stride[0] + h * c->mask_stride[1] + i * c->mask_stride[2] : NULL;
    for (size_t j = 0; j < c->S; j++) {
        int v = !c->causal || (long long)j <= last;
        if (v && mrow) v = mrow[j * c->mask_stride[3]] != 0;
        visible[j] = (unsigned char)v;
    }
}

/*
 * The forward pass, once per accumulator type acc_t (float for float32, float16 and
 * bfloat16; double for float64). Every stage is computed one row at a time in acc_t,
 * stored in the case's dtype (rounded to nearest, ties to even) and, when a later
 * stage reads it, loaded back from there: a stage is used as it was returned.
 * Inner loops walk memory contiguously and sum in index order.
 */
#define DEFINE_FORWARD(SFX, acc_t, EXP)                                                                 \
    /* y[j] = (((y[j] + a0 x0[j]) + a1 x1[j]) + a2 x2[j]) + a3 x3[j] for j < n: four terms of a sum,   \
     * added in index order. Blocks of 8 with restrict pointers let gcc -O2 vectorize it. */          \
    static void axpy4_##SFX(size_t n, acc_t *restrict y, acc_t a0, const acc_t *restrict x0, acc_t a1,  \
                            const acc_t *restrict x1, acc_t a2, const acc_t *restrict x2, acc_t a3,     \
                            const acc_t *restrict x3) {                                                 \
        size_t j = 0;                                                                                   \
        for (; j + 8 <= n; j += 8)                                                                      \
            for (size_t u = j; u < j + 8; u++) y[u] = (((y[u] + a0 * x0[u]) + a1 * x1[u]) + a2 * x2[u]) + a3 * x3[u]; \
        for (; j < n; j++) y[j] = (((y[j] + a0 * x0[j]) + a1 * x1[j]) + a2 * x2[j]) + a3 * x3[j];      \
    }                                                                                                   \
    /* y[j] += a x[j] for j < n. */                                                                     \
    static void axpy1_##SFX(size_t n, acc_t *restrict y, acc_t a, const acc_t *restrict x) {            \
        size_t j = 0;                                                                                   \
        for (; j + 8 <= n; j += 8)                                                                      \
            for (size_t u = j; u < j + 8; u++) y[u] += a * x[u];                                        \
        for (; j < n; j++) y[j] += a * x[j];                                                            \
    }                                                                                                   \
    /* n float64 payload values from element off, rounded to dt, in acc_t. */                          \
    static void load_input_##SFX(dtype_t dt, const unsigned char *f64, size_t off, acc_t *dst, size_t n) { \
        for (size_t i = 0; i < n; i++) dst[i] = (acc_t)round_to(dt, rd_f64(f64 + 8 * (off + i)));      \
    }                                                                                                   \
    /* n values of a stage (stored in dt) from element off, in acc_t (exact). */                       \
    static void load_stage_##SFX(dtype_t dt, const void *base, size_t off, acc_t *dst, size_t n) {      \
        size_t i;                                                                                       \
        switch (dt) {                                                                                   \
        case DT_F64: for (i = 0; i < n; i++) dst[i] = (acc_t)((const double *)base)[off + i]; break;    \
        case DT_F32: for (i = 0; i < n; i++) dst[i] = (acc_t)((const float *)base)[off + i]; break;     \
        case DT_F16: for (i = 0; i < n; i++) dst[i] = (acc_t)f16_to_float(((const uint16_t *)base)[off + i]); break; \
        case DT_BF16: for (i = 0; i < n; i++) dst[i] = (acc_t)bf16_to_float(((const uint16_t *)base)[off + i]); break; \
        }                                                                                               \
    }                                                                                                   \
    /* n acc_t values stored in dt at element off: rounded once, to nearest even. */                   \
    static void store_stage_##SFX(dtype_t dt, void *base, size_t off, const acc_t *src, size_t n) {     \
        const int is_float = sizeof(acc_t) == sizeof(float);                                           \
        size_t i;                                                                                       \
        switch (dt) {                                                                                   \
        case DT_F64: for (i = 0; i < n; i++) ((double *)base)[off + i] = (double)src[i]; break;         \
        case DT_F32: for (i = 0; i < n; i++) ((float *)base)[off + i] = (float)src[i]; break;           \
        case DT_F16:                                                                                    \
            for (i = 0; i < n; i++)                                                                     \
                ((uint16_t *)base)[off + i] = is_float ? f16_from_float((float)src[i]) : f16_from_double((double)src[i]); \
            break;                                                                                      \
        case DT_BF16:                                                                                   \
            for (i = 0; i < n; i++)                                                                     \
                ((uint16_t *)base)[off + i] = is_float ? bf16_from_float((float)src[i]) : bf16_from_double((double)src[i]); \
            break;                                                                                      \
        }                                                                                               \
    }                                                                                                   \
    /* y = x . W + b for `rows` rows: x from the float64 payload (x_f64) or from a stage             \
     * (x_stage); W (in, out) and b (out) from the payload; y stored in dt. */                        \
    static int linear_##SFX(dtype_t dt, size_t rows, size_t in, size_t out, const unsigned char *x_f64, \
                            const void *x_stage, const unsigned char *w_f64, const unsigned char *b_f64, void *y_stage) { \
        acc_t *W = malloc(in * out * sizeof *W), *bias = malloc(out * sizeof *bias);                    \
        acc_t *x = malloc(in * sizeof *x), *y = malloc(out * sizeof *y);                                \
        int r = (W && bias && x && y) ? 0 : -1;                                                         \
        if (!r) {                                                                                       \
            load_input_##SFX(dt, w_f64, 0, W, in * out);                                                \
            if (b_f64) load_input_##SFX(dt, b_f64, 0, bias, out);                                       \
            for (size_t row = 0; row < rows; row++) {                                                   \
                if (x_f64) load_input_##SFX(dt, x_f64, row * in, x, in);                                \
                else load_stage_##SFX(dt, x_stage, row * in, x, in);                                    \
                for (size_t j = 0; j < out; j++) y[j] = 0;                                              \
                size_t k = 0;                                                                           \
                for (; k + 4 <= in; k += 4) /* y += x[k] W[k,:], four k a pass, summed in order */      \
                    axpy4_##SFX(out, y, x[k], W + k * out, x[k + 1], W + (k + 1) * out, x[k + 2],       \
                                W + (k + 2) * out, x[k + 3], W + (k + 3) * out);                        \
                for (; k < in; k++) axpy1_##SFX(out, y, x[k], W + k * out);                             \
                if (b_f64) for (size_t j = 0; j < out; j++) y[j] += bias[j];                           \
                store_stage_##SFX(dt, y_stage, row * out, y, out);                                      \
            }                                                                                           \
        }                                                                                               \
        free(W); free(bias); free(x); free(y);                                                          \
        return r;                                                                                       \
    }                                                                                                   \
    static int forward_##SFX(const mha_case *c, void *const st[N_STAGES]) {                            \
        const dtype_t dt = c->dt;                                                                       \
        const size_t B = c->B, T = c->T, S = c->S, H = c->H, G = c->H_kv, Dk = c->D_k, Dv = c->D_v;     \
        const size_t group = H / G, nq = H * Dk, nk = G * Dk, nv = G * Dv, nc = H * Dv;                 \
        if (linear_##SFX(dt, B * T, c->d_model, nq, c->query, NULL, c->w_q, c->b_q, st[Q_PROJ]) ||       \
            linear_##SFX(dt, B * S, c->kdim, nk, c->key, NULL, c->w_k, c->b_k, st[K_PROJ]) ||           \
            linear_##SFX(dt, B * S, c->vdim, nv, c->value, NULL, c->w_v, c->b_v, st[V_PROJ]))           \
            return -1;                                                                                  \
        const acc_t scale = (acc_t)round_to(dt, c->scale); /* the scale in the dtype */                \
        acc_t *Kt = malloc(Dk * S * sizeof *Kt);   /* key head g, transposed: (D_k, S) */              \
        acc_t *V = malloc(S * Dv * sizeof *V);     /* value head g: (S, D_v) */                        \
        acc_t *q = malloc(Dk * sizeof *q), *krow = malloc(Dk * sizeof *krow), *o = malloc(Dv * sizeof *o); \
        acc_t *s = malloc(S * sizeof *s), *p = malloc(S * sizeof *p);                                   \
        unsigned char *vis = malloc(S);                                                                 \
        int r = (Kt && V && q && krow && o && s && p && vis) ? 0 : -1;                                  \
        for (size_t b = 0; !r && b < B; b++)                                                            \
            for (size_t g = 0; g < G; g++) {                                                            \
                for (size_t j = 0; j < S; j++) {                                                        \
                    load_stage_##SFX(dt, st[K_PROJ], (b * S + j) * nk + g * Dk, krow, Dk);              \
                    for (size_t d = 0; d < Dk; d++) Kt[d * S + j] = krow[d];                            \
                    load_stage_##SFX(dt, st[V_PROJ], (b * S + j) * nv + g * Dv, V + j * Dv, Dv);        \
                }                                                                                       \
                for (size_t h = g * group; h < (g + 1) * group; h++) /* GQA: head h reads h / group */ \
                    for (size_t i = 0; i < T; i++) {                                                    \
                        const size_t row = (b * H + h) * T + i; /* (b, h, i) */                        \
                        /* scores[j] = (q . k_j) * scale, for every j, masked or not */                 \
                        load_stage_##SFX(dt, st[Q_PROJ], (b * T + i) * nq + h * Dk, q, Dk);             \
                        for (size_t j = 0; j < S; j++) s[j] = 0;                                        \
                        size_t d = 0;                                                                   \
                        for (; d + 4 <= Dk; d += 4)                                                     \
                            axpy4_##SFX(S, s, q[d], Kt + d * S, q[d + 1], Kt + (d + 1) * S, q[d + 2],   \
                                        Kt + (d + 2) * S, q[d + 3], Kt + (d + 3) * S);                  \
                        for (; d < Dk; d++) axpy1_##SFX(S, s, q[d], Kt + d * S);                        \
                        if (!bug_no_scale) for (size_t j = 0; j < S; j++) s[j] *= scale;               \
                        store_stage_##SFX(dt, st[SCORES], row * S, s, S);                               \
                        load_stage_##SFX(dt, st[SCORES], row * S, s, S);                                \
                        /* softmax over the visible keys: max-subtracted, in acc_t */                   \
                        visible_row(c, b, h, i, vis);                                                   \
                        int any = 0;                                                                    \
                        acc_t peak = 0, sum = 0;                                                        \
                        for (size_t j = 0; j < S; j++)                                                  \
                            if (vis[j] && (!any || s[j] > peak)) { peak = s[j]; any = 1; }              \
                        for (size_t j = 0; j < S; j++) {                                                \
                            p[j] = vis[j] ? EXP(s[j] - peak) : 0;                                       \
                            sum += p[j];                                                                \
                        }                                                                               \
                        for (size_t j = 0; j < S; j++) p[j] = sum > 0 ? p[j] / sum : 0; /* no key: 0 */ \
                        store_stage_##SFX(dt, st[ATTN_WEIGHTS], row * S, p, S);                         \
                        load_stage_##SFX(dt, st[ATTN_WEIGHTS], row * S, p, S);                          \
                        /* head_outputs = sum_j p_j v_j */                                              \
                        for (size_t e = 0; e < Dv; e++) o[e] = 0;                                       \
                        size_t j = 0;                                                                   \
                        for (; j + 4 <= S; j += 4)                                                      \
                            axpy4_##SFX(Dv, o, p[j], V + j * Dv, p[j + 1], V + (j + 1) * Dv, p[j + 2],  \
                                        V + (j + 2) * Dv, p[j + 3], V + (j + 3) * Dv);                  \
                        for (; j < S; j++) axpy1_##SFX(Dv, o, p[j], V + j * Dv);                        \
                        store_stage_##SFX(dt, st[HEAD_OUTPUTS], row * Dv, o, Dv);                       \
                    }                                                                                   \
            }                                                                                           \
        free(Kt); free(V); free(q); free(krow); free(o); free(s); free(p); free(vis);                   \
        if (r) return -1;                                                                               \
        /* concat (B, T, H*D_v): head_outputs (B, H, T, D_v) transposed, copied as stored */            \
        const size_t item = DT_SIZE[dt];                                                                \
        for (size_t b = 0; b < B; b++)                                                                  \
            for (size_t i = 0; i < T; i++)                                                              \
                for (size_t h = 0; h < H; h++)                                                          \
                    memcpy((char *)st[CONCAT] + ((b * T + i) * nc + h * Dv) * item,                     \
                           (const char *)st[HEAD_OUTPUTS] + (((b * H + h) * T + i) * Dv) * item, Dv * item); \
        return linear_##SFX(dt, B * T, nc, c->d_out, NULL, st[CONCAT], c->w_o, c->b_o, st[OUTPUT]);     \
    }

DEFINE_FORWARD(f, float, expf)
DEFINE_FORWARD(d, double, exp)

/*
 * Fill the eight stages of case c. st[k] is the buffer of stage STAGE_NAME[k], in the
 * case's dtype (double, float, or uint16_t raw bits for float16/bfloat16), C order,
 * shapes as docs/spec.md section 2. 0 on success; -1 (out of memory) otherwise.
 * To validate your own kernel: call it here.
 */
static int mha_forward(const mha_case *c, void *const st[N_STAGES]) {
    return c->dt == DT_F64 ? forward_d(c, st) : forward_f(c, st);
}

/* ===================================================================== */
/* 6. Serving: ready, then one reply per request                          */
/* ===================================================================== */

static int send_header(int wfd, sbuf *h, const unsigned char *payload, uint64_t plen) {
    if (h->oom) { fprintf(stderr, PROGRAM_NAME ": out of memory\n"); return -1; }
    if (write_frame(wfd, h->p, h->n, payload, plen)) {
        fprintf(stderr, PROGRAM_NAME ": cannot write to the reply pipe: %s\n", strerror(errno));
        return -1;
    }
    return 0;
}

/* The number of the request being answered (its "seq"), echoed in every reply so that the runner can
   tell a reply to another request apart; -1: the request had none. */
static long long g_seq = -1;

static void sb_seq(sbuf *h) {
    if (g_seq >= 0) sb_printf(h, ",\"seq\":%lld", g_seq);
}

static int send_failure(int wfd, const char *reply, const char *error) {
    sbuf h = {0};
    sb_printf(&h, "{\"reply\":\"%s\",\"ok\":false,\"error\":", reply);
    sb_json_string(&h, error);
    sb_seq(&h);
    sb_puts(&h, "}");
    int r = send_header(wfd, &h, NULL, 0);
    free(h.p);
    return r;
}

static int send_ready(int wfd) {
    sbuf h = {0};
    sb_puts(&h, "{\"reply\":\"ready\",\"protocol\":\"" PROTOCOL "\",\"ok\":true,\"name\":");
    sb_json_string(&h, bug_no_scale ? PROGRAM_NAME "[bug:no-scale]" : PROGRAM_NAME);
    sb_puts(&h, ",\"dtypes\":[\"float64\",\"float32\",\"float16\",\"bfloat16\"],\"deviations\":[],"
                "\"framework\":null,\"framework_version\":null,\"has_supports\":false,\"has_backward\":false,"
                "\"environment\":{\"process\":\"exec\",\"language\":\"C\",");
    sb_printf(&h, "\"standard\":\"C%ld\",", (long)__STDC_VERSION__);
#if defined(__clang__)
    sb_puts(&h, "\"compiler\":");
    sb_json_string(&h, "clang " __clang_version__);
#elif defined(__GNUC__)
    sb_puts(&h, "\"compiler\":");
    sb_json_string(&h, "gcc " __VERSION__);
#else
    sb_puts(&h, "\"compiler\":null");
#endif
    sb_printf(&h, ",\"pid\":%ld,\"threads\":1}}", (long)getpid());
    int r = send_header(wfd, &h, NULL, 0);
    free(h.p);
    return r;
}

/* The reply payload for case c: a safetensors header, padded with spaces to a multiple
 * of 8, then the stages back to back; st[k] points at each stage's bytes. */
static unsigned char *stage_payload(const mha_case *c, void *st[N_STAGES], uint64_t *len) {
    const size_t B = c->B, T = c->T, S = c->S, H = c->H;
    const uint64_t shapes[N_STAGES][4] = {
        {B, T, H * c->D_k}, {B, S, c->H_kv * c->D_k}, {B, S, c->H_kv * c->D_v}, {B, H, T, S},
        {B, H, T, S},       {B, H, T, c->D_v},        {B, T, H * c->D_v},       {B, T, c->d_out}};
    const int rank[N_STAGES] = {3, 3, 3, 4, 4, 4, 3, 3};
    uint64_t offset[N_STAGES], total = 0;
    sbuf h = {0};
    sb_puts(&h, "{");
    for (int k = 0; k < N_STAGES; k++) {
        uint64_t n = DT_SIZE[c->dt];
        for (int d = 0; d < rank[k]; d++) n = shapes[k][d] > MAX_PAYLOAD / n ? MAX_PAYLOAD + 1 : n * shapes[k][d];
        if (n > MAX_PAYLOAD || total > MAX_PAYLOAD) { free(h.p); return NULL; }
        offset[k] = total;
        total += n;
        sb_printf(&h, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", k ? "," : "", STAGE_NAME[k], DT_CODE[c->dt]);
        for (int d = 0; d < rank[k]; d++) sb_printf(&h, "%s%llu", d ? "," : "", (unsigned long long)shapes[k][d]);
        sb_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset[k], (unsigned long long)(offset[k] + n));
    }
    sb_puts(&h, "}");
    while (h.n % 8) sb_puts(&h, " ");
    unsigned char *buf = (h.oom || total > MAX_PAYLOAD || (uint64_t)SIZE_MAX - 8 - h.n < total) ? NULL : malloc(8 + h.n + total);
    if (buf) {
        put_le64(buf, h.n);
        memcpy(buf + 8, h.p, h.n);
        for (int k = 0; k < N_STAGES; k++) st[k] = buf + 8 + h.n + offset[k]; /* aligned: one dtype */
        *len = 8 + h.n + total;
    }
    free(h.p);
    return buf;
}

static int run_case(int wfd, const mha_case *c) {
    void *st[N_STAGES];
    uint64_t len = 0;
    unsigned char *payload = stage_payload(c, st, &len);
    if (!payload) return send_failure(wfd, "run", "out of memory for the stages (" PROGRAM_NAME ")");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int r = mha_forward(c, st);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (r) {
        free(payload);
        return send_failure(wfd, "run", "out of memory while computing (" PROGRAM_NAME ")");
    }
    double seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    sbuf h = {0};
    sb_printf(&h, "{\"reply\":\"run\",\"ok\":true,\"seconds\":%.9f,\"mapping\":true,\"keys\":[", seconds < 0 ? 0.0 : seconds);
    for (int k = 0; k < N_STAGES; k++) sb_printf(&h, "%s\"%s\"", k ? "," : "", STAGE_NAME[k]);
    sb_puts(&h, "],\"special\":{}");
    sb_seq(&h);
    sb_puts(&h, "}");
    r = send_header(wfd, &h, payload, len);
    free(h.p);
    free(payload);
    return r;
}

/* Serve requests until close or end of file: 0; -1 when the pipes fail. */
static int serve(int rfd, int wfd) {
    mha_case held;              /* the last case sent (for "reuse": true) */
    unsigned char *held_payload = NULL;
    int have_case = 0;
    char held_err[512] = "no case was sent before this reuse request";
    for (;;) {
        unsigned char head[16];
        int r = read_exact(rfd, head, 16);
        if (r == 1) return 0; /* end of file: the runner is done */
        if (r) { fprintf(stderr, PROGRAM_NAME ": the request pipe ended inside a frame\n"); return -1; }
        uint64_t hl = le64(head), pl = le64(head + 8);
        if (hl > MAX_HEADER || pl > MAX_PAYLOAD) {
            fprintf(stderr, PROGRAM_NAME ": not a frame (header %llu bytes, payload %llu bytes)\n",
                    (unsigned long long)hl, (unsigned long long)pl);
            return -1;
        }
        char *text = malloc(hl + 1);
        if (!text) { fprintf(stderr, PROGRAM_NAME ": out of memory\n"); return -1; }
        if (read_exact(rfd, text, hl)) { free(text); fprintf(stderr, PROGRAM_NAME ": the request pipe ended inside a frame\n"); return -1; }
        text[hl] = '\0';
        jval req;
        char err[512];
        int parsed = jparse(text, hl, &req, err, sizeof err) == 0 && req.type == J_OBJ;
        free(text);
        if (!parsed) {
            g_seq = -1;
            if (skip_bytes(rfd, pl)) return -1;
            char msg[600];
            snprintf(msg, sizeof msg, "the request header is not a JSON object (%s)", err);
            if (send_failure(wfd, "run", msg)) return -1;
            continue;
        }
        const jval *op = jget(&req, "op"), *cj = jget(&req, "case"), *reuse = jget(&req, "reuse");
        const jval *seq = jget(&req, "seq");
        g_seq = seq && seq->type == J_NUM && seq->is_int && seq->inum >= 0 ? seq->inum : -1;
        if (jis_str(op, "close")) { jfree(&req); free(held_payload); return 0; }
        if (cj) { /* a new case: forget the old one first (one payload at a time) */
            free(held_payload);
            held_payload = NULL;
            have_case = 0;
            held_payload = malloc(pl ? pl : 1);
            if (!held_payload) {
                snprintf(held_err, sizeof held_err, "out of memory for a payload of %llu bytes", (unsigned long long)pl);
                if (skip_bytes(rfd, pl)) return -1;
            } else {
                if (pl && read_exact(rfd, held_payload, (size_t)pl)) { fprintf(stderr, PROGRAM_NAME ": the request pipe ended inside a frame\n"); return -1; }
                have_case = read_case(cj, held_payload, pl, &held, held_err, sizeof held_err) == 0;
            }
        } else if (skip_bytes(rfd, pl)) {
            return -1;
        }
        int w;
        char nm[64];
        if (jis_str(op, "run")) {
            if (!cj && !(reuse && reuse->type == J_TRUE)) w = send_failure(wfd, "run", "a run request with neither a case nor \"reuse\": true");
            else if (!have_case) w = send_failure(wfd, "run", held_err);
            else w = run_case(wfd, &held);
        } else if (jis_str(op, "supports") || jis_str(op, "supports+run") || jis_str(op, "supports+backward")) {
            w = send_failure(wfd, "supports", PROGRAM_NAME " answers no supports request (its ready said has_supports: false)");
        } else if (jis_str(op, "backward")) {
            w = send_failure(wfd, "backward", PROGRAM_NAME " computes no backward (its ready said has_backward: false)");
        } else {
            snprintf(err, sizeof err, "unknown request op '%s'",
                     op && op->type == J_STR ? printable(op->str, op->len, nm, sizeof nm) : "(none)");
            w = send_failure(wfd, "run", err);
        }
        jfree(&req);
        if (w) { free(held_payload); return -1; }
    }
}

static int parse_fd(const char *s, const char *end, int *fd) {
    long v = 0;
    if (s == end || end - s > 9) return -1;
    for (const char *p = s; p < end; p++) {
        if (!isdig(*p)) return -1;
        v = v * 10 + (*p - '0');
    }
    *fd = (int)v;
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bug") && i + 1 < argc && !strcmp(argv[i + 1], "no-scale")) { bug_no_scale = 1; i++; }
        else if (!strcmp(argv[i], "--bug=no-scale")) bug_no_scale = 1;
        else {
            fprintf(stderr, "usage: %s [--bug no-scale]  (a worker program for mhaspec: mhaspec run \"exec:%s\")\n", argv[0], argv[0]);
            return 2;
        }
    }
    const char *fds = getenv("MHASPEC_WIRE_FDS");
    const char *comma = fds ? strchr(fds, ',') : NULL;
    int rfd = -1, wfd = -1;
    if (!comma || parse_fd(fds, comma, &rfd) || parse_fd(comma + 1, comma + strlen(comma), &wfd) ||
        fcntl(rfd, F_GETFD) < 0 || fcntl(wfd, F_GETFD) < 0) {
        fprintf(stderr, "%s: MHASPEC_WIRE_FDS must be READ_FD,WRITE_FD, two open descriptors (got %s%s%s); "
                "run me under mhaspec: mhaspec run \"exec:%s\"\n", argv[0], fds ? "'" : "", fds ? fds : "nothing",
                fds ? "'" : "", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN); /* a gone runner is a write error, not a signal */
    for (uint32_t h = 0; h < 65536; h++) F16_TO_FLOAT[h] = f16_decode((uint16_t)h);
    if (send_ready(wfd)) return 1;
    return serve(rfd, wfd) ? 1 : 0;
}
