/* trtkv's CPU attention kernels over the paged quantized KV cache (docs/kv-cache-format.md, docs/torch-engine.md).

   The torch engine's attention on CPU reads the sealed blocks of every sequence straight from the pools through its
   block table: no gathered copy, no intermediate tensors. Two entry points, each over [B, H] (sequence, KV head):

     trtkv_decode   one new token per sequence: the whole attention (sealed blocks, sink rows, open block, the new row;
                    window, soft-cap, softmax), the sealed part of the output in stored space, the rest in model space
     trtkv_dequant  sealed rows -> float32 out [B, H, out_rows, D] (rows 0 .. nb * bs - 1) in model space (the
                    format's transforms undone by butterflies in registers), for one fused torch attention over
                    them and the rows the caller puts after them (prefill)

   Sequence b reads columns 0 .. held[b]-1 of its block table (held[b] * bs rows); rows past them are written as zeros
   or skipped, so blocks of other owners are never read. ``trtkv_dequant`` takes rows below ``sink_tokens`` of column 0
   from ``sink`` [B, H, sink_tokens, D] (float32, model space) where ``sink_ok`` (NULL: every b) says so;
   ``trtkv_decode`` reads them from the tails (model space).

   A row is decoded by lookup tables, the storage dtype's own codec (trtkv.formats.DtypeTraits.plane_tables /
   byte_table, built in Python): plane p holds ``per[p]`` codes per byte from byte ``byte_off[p]`` of the row, and
   byte value v adds ``table[p][v * per[p] + i]`` to channel ``j * per[p] + i`` (the first plane's table already
   subtracts the symmetric offset); integer dtypes whose tables are plain bit fields (every one today: Python checks)
   decode by shifts instead, which vectorize. fp16 rows are converted directly. Then the scale (and zero-point) of the format's
   granularity: x = value * scale + zero. A ``nuq`` format's codes are indices into the layer's calibrated levels
   (``codebook``), an ``outN`` block's listed elements are written over its decoded rows (``oidx`` / ``oval``), and
   keys stored before RoPE (``pre_rope``) are taken back to model space -- inverse rotation, smoothing, RoPE at each
   row's position from the model's table (``rope_cos`` / ``rope_sin``, ``first_pos``) -- both entry points then read
   them in model space. ``trtkv_decode`` splits its [B, H] pairs over ``threads`` OpenMP threads (the
   engine passes torch's thread count of the step; the library links the libgomp torch has loaded, so they are torch's
   own warm pool: a fresh thread per call waits for an idle core to wake, milliseconds on a VM), in ranges of about
   equal rows read; ``trtkv_dequant`` its [B, H] pairs and the seal (below) its (block, head) slabs, in equal shares. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef _Float16 half;
#define MAX_THREADS 64  /* OpenMP threads per call at most */
typedef float v8f __attribute__((vector_size(32)));  /* 8 floats: one AVX register where there is one */

static inline v8f load8(const float *p) { v8f v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { __builtin_memcpy(p, &v, sizeof v); }
#if defined(__AVX__)
#include <immintrin.h>
/* ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)) by three adds of halves (the lane-by-lane form compiled to seven
   extracts and scalar adds: most of a dot product's time at head_dim 64) */
static inline float hsum8(v8f v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehl_ps(t, t)));
}
#else
static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
#endif

#if defined(__F16C__)
#include <immintrin.h>
/* fp16 -> float32, 8 at a time (the compiler does not vectorize the _Float16 conversion by itself) */
static inline void half_to_float(const half *restrict src, float *restrict dst, int64_t n) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
    for (; d < n; d++) dst[d] = (float)src[d];
}
#else
static inline void half_to_float(const half *restrict src, float *restrict dst, int64_t n) {
    for (int64_t d = 0; d < n; d++) dst[d] = (float)src[d];
}
#endif

enum { KIND_FP16 = 0, KIND_LUT = 1, KIND_CHANNELS = 2 };
enum { GRAN_NONE = 0, GRAN_STATIC = 1, GRAN_TOKEN = 2, GRAN_BLOCK_CHANNEL = 3 };
#define MAX_PLANES 4
#define MAX_HEAD_DIM 1024

typedef struct {
    int64_t kind, head_dim, block_size, num_heads, row_bytes;
    int64_t n_planes, byte_off[MAX_PLANES], per[MAX_PLANES];
    const float *table[MAX_PLANES];
    /* linear codes (every int dtype): plane p's code bits are (byte >> i * width[p]) & mask << low[p], minus ``offset``;
       decoded with shifts instead of lookups (the tables say the same: Python checks they agree). 0: look up. */
    int64_t linear, width[MAX_PLANES], low[MAX_PLANES], signed_bytes;
    float offset;
    int64_t gran, groups;       /* GRAN_TOKEN: scale [NB, H, bs, groups] */
    const float *static_scale;  /* GRAN_STATIC: [H, D] */
    /* the format's transforms (trtkv.quant.forward_transform: x / smooth, then @ rot), for a decode in model space:
       NULL where the format has none */
    const float *smooth;        /* [H, D] */
    const float *rot;           /* [D, D] the Hadamard matrix */
    /* nuq formats: a code is an index into a calibrated table of ``levels`` values (code units, before the scale), one
       table per layer (codebook_heads 1) or per KV head (codebook_heads H); NULL: a code is its own value */
    const float *codebook;
    int64_t levels, codebook_heads;
    /* outN formats: a sealed block keeps ``outliers`` elements per KV head aside (Ctx.oidx / oval), written over the
       decoded codes; pre_rope: keys stored before RoPE, which a read brings back to model space (the transforms undone,
       RoPE at each row's position: Ctx.rope_*) */
    int64_t outliers, pre_rope;
    /* KIND_CHANNELS (allocB formats): channel d of head h has its own code width; its code is the bits
       chan_off[h * D + d] .. + width of the row (read from that byte and the next, the row's last byte standing in for
       the one past it), masked by chan_mask[h * D + d] = 2^width - 1 (0: no code, the block's zero-point alone);
       channels in their own order, each code after the one before (formats.channel_offsets) */
    const int32_t *chan_off, *chan_mask;
} Fmt;

typedef struct {
    const uint8_t *data;        /* [NB, H, bs, row_bytes] */
    const half *scale, *zero;   /* by granularity; zero NULL when symmetric */
    const int64_t *tables;      /* [B, cols] */
    int64_t cols;
    const int64_t *held;        /* [B] */
    int64_t batch, nb;
    const float *sink;          /* [B, H, sink_tokens, D] or NULL */
    const uint8_t *sink_ok;     /* [B] or NULL */
    int64_t sink_tokens;
    const int16_t *oidx;        /* [NB, H, outliers] positions token * D + channel in the block (outN formats) */
    const half *oval;           /* [NB, H, outliers] their values (stored space) */
    const float *rope_cos, *rope_sin; /* the model's RoPE at positions 0 .. rope_rows - 1 (pre_rope): channel d < D / 2 of */
    int64_t rope_rows;                /* position p at p * rope_stride + d, channel D / 2 + d at p * rope_stride + rope_hoff + d */
    int64_t rope_stride, rope_hoff;   /* (equal halves: the first alone, stride D / 2 and hoff 0; else D and D / 2) */
    const int64_t *first_pos;   /* [B] position of sealed column 0, row 0 (pre_rope) */
} Ctx;

/* One bit plane's lookups: byte j of the plane gives channels j * PER .. j * PER + PER - 1 (a fixed PER per
   instance, so the compiler unrolls the copy instead of calling memcpy); ADD: accumulate into x (planes after the first). */
#define LUT_PLANE(NAME, PER, OP)                                                                              \
    static inline void NAME(const uint8_t *restrict bytes, const float *restrict tab, int64_t D, float *restrict x) { \
        for (int64_t j = 0; j < D / PER; j++) {                                                               \
            const float *restrict e = tab + (int64_t)bytes[j] * PER;                                           \
            for (int i = 0; i < PER; i++) x[j * PER + i] OP e[i];                                              \
        }                                                                                                     \
    }
LUT_PLANE(lut_set1, 1, =)
LUT_PLANE(lut_set2, 2, =)
LUT_PLANE(lut_set4, 4, =)
LUT_PLANE(lut_set8, 8, =)
LUT_PLANE(lut_add1, 1, +=)
LUT_PLANE(lut_add2, 2, +=)
LUT_PLANE(lut_add4, 4, +=)
LUT_PLANE(lut_add8, 8, +=)

static inline void lut_plane(const uint8_t *restrict bytes, const float *restrict tab, int64_t per, int add, int64_t D, float *restrict x) {
    switch (per * 2 + add) {
    case 2: lut_set1(bytes, tab, D, x); break;
    case 4: lut_set2(bytes, tab, D, x); break;
    case 8: lut_set4(bytes, tab, D, x); break;
    case 16: lut_set8(bytes, tab, D, x); break;
    case 3: lut_add1(bytes, tab, D, x); break;
    case 5: lut_add2(bytes, tab, D, x); break;
    case 9: lut_add4(bytes, tab, D, x); break;
    case 17: lut_add8(bytes, tab, D, x); break;
    }
}

/* A linear plane: channel j * PER + i holds bits (byte_j >> i * W) & (2^W - 1), shifted left by LOW (ADD: planes after the
   first add their bits). Fixed PER / W per instance so the loops vectorize. */
#define LIN_PLANE(NAME, PER, W)                                                                                        \
    static inline void NAME(const uint8_t *restrict bytes, int64_t low, int add, int64_t D, float *restrict x) {       \
        const float scale = (float)(1 << low);                                                                      \
        for (int64_t j = 0; j < D / PER; j++)                                                                       \
            for (int i = 0; i < PER; i++) {                                                                         \
                const float v = (float)((bytes[j] >> (i * W)) & ((1 << W) - 1)) * scale;                            \
                x[j * PER + i] = add ? x[j * PER + i] + v : v;                                                      \
            }                                                                                                       \
    }
LIN_PLANE(lin_plane1, 1, 8)
LIN_PLANE(lin_plane2, 2, 4)
LIN_PLANE(lin_plane4, 4, 2)
LIN_PLANE(lin_plane8, 8, 1)

#if defined(__AVX2__)
/* One plane of 4-bit fields from bit 0 (int4): channel 2j is byte j's low nibble, 2j + 1 its high one; 32 channels per
   16 bytes, minus the offset, in the one pass (the generic loop below does not vectorize the interleave). */
static inline int nibbles(const uint8_t *restrict bytes, float offset, int64_t D, float *restrict x) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256 off = _mm256_set1_ps(offset);
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(bytes + d / 2));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
        _mm256_storeu_ps(x + d, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)), off));
        _mm256_storeu_ps(x + d + 8, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))), off));
        _mm256_storeu_ps(x + d + 16, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), off));
        _mm256_storeu_ps(x + d + 24, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), off));
    }
    for (; d < D; d += 2) {
        const uint8_t v = bytes[d / 2];
        x[d] = (float)(v & 15) - offset;
        if (d + 1 < D) x[d + 1] = (float)(v >> 4) - offset;
    }
    return 1;
}
#define NIBBLES(f) ((f)->n_planes == 1 && (f)->per[0] == 2 && (f)->low[0] == 0)

/* Byte v of a plane of 2-bit fields as its 4 codes (one per byte, little end first), and of 1-bit fields as its 8:
   filled once when the library loads. */
static uint32_t FIELDS2[256];
static uint64_t FIELDS1[256];
__attribute__((constructor)) static void fill_fields(void) {
    for (int v = 0; v < 256; v++) {
        FIELDS2[v] = 0, FIELDS1[v] = 0;
        for (int i = 0; i < 4; i++) FIELDS2[v] |= (uint32_t)((v >> (2 * i)) & 3) << (8 * i);
        for (int i = 0; i < 8; i++) FIELDS1[v] |= (uint64_t)((v >> i) & 1) << (8 * i);
    }
}

/* Planes of 2- and 1-bit fields (int3, int2: the 2-bit plane the low one), ``rows`` rows of D a multiple of 32 into
   out [rows, D]: 32 channels per pass, every plane's fields spread to one byte per channel in a register -- a byte of
   2-bit fields copied to its 4 channels and masked to its own field (folded to the low bits by shifts of the whole
   register: one field per byte is set), a byte of 1-bit fields to its 8 channels by a compare with each channel's bit
   -- then 8 channels at a time to floats minus the offset, or to a codebook's levels (at most 8) by one register
   permute. A block's rows in one call: the constants are set once (the compiler made gathers of small_fields' tables,
   which cost more than the rest of a row's decode). 0: not this layout. */
static inline int small_fields_rows(const Fmt *f, const uint8_t *restrict data, int64_t rows, int64_t D, const float *restrict cb,
                                    float *restrict out) {
    if ((D & 31) || f->signed_bytes || (cb && f->levels > 8)) return 0;
    for (int64_t p = 0; p < f->n_planes; p++)
        if (!(f->per[p] == 8 || (f->per[p] == 4 && f->low[p] == 0))) return 0;  /* int3, int2: the 2-bit plane is the low one */
    const __m256i spread2 = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    const __m256i field2 = _mm256_set1_epi32((int)0xC0300C03u);  /* bytes 3, 12, 48, 192: channel i of a byte's 4 */
    const __m256i spread1 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit1 = _mm256_set1_epi64x((long long)0x8040201008040201ull), three = _mm256_set1_epi8(3);
    __m256 levels = _mm256_setzero_ps();
    if (cb) {
        float book[8] = {0};
        memcpy(book, cb, (size_t)f->levels * sizeof(float));
        levels = _mm256_loadu_ps(book);
    }
    const __m256 off = _mm256_set1_ps(f->offset);
    for (int64_t t = 0; t < rows; t++) {
        const uint8_t *restrict row = data + t * f->row_bytes;
        float *restrict x = out + t * D;
        for (int64_t d = 0; d < D; d += 32) {
            __m256i code = _mm256_setzero_si256();
            for (int64_t p = 0; p < f->n_planes; p++) {
                const uint8_t *restrict bytes = row + f->byte_off[p];
                if (f->per[p] == 4) {  /* 8 bytes: channels d .. d + 31 */
                    int64_t eight;
                    memcpy(&eight, bytes + d / 4, 8);
                    const __m256i src = _mm256_set1_epi64x(eight);  /* bytes 0-7 in both lanes */
                    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(src, spread2), field2);
                    v = _mm256_or_si256(_mm256_or_si256(v, _mm256_srli_epi16(v, 2)), _mm256_or_si256(_mm256_srli_epi16(v, 4), _mm256_srli_epi16(v, 6)));
                    v = _mm256_and_si256(v, three);
                    code = _mm256_or_si256(code, v);
                } else {  /* 4 bytes: channels d .. d + 31 */
                    int32_t four;
                    memcpy(&four, bytes + d / 8, 4);
                    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(four), spread1);
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit1), bit1);
                    code = _mm256_or_si256(code, _mm256_and_si256(set, _mm256_set1_epi8((char)(1 << f->low[p]))));
                }
            }
            const __m128i lo = _mm256_castsi256_si128(code), hi = _mm256_extracti128_si256(code, 1);
            const __m256i c8[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), _mm256_cvtepu8_epi32(hi),
                                   _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(x + d + 8 * k, cb ? _mm256_permutevar8x32_ps(levels, c8[k]) : _mm256_sub_ps(_mm256_cvtepi32_ps(c8[k]), off));
        }
    }
    return 1;
}

/* Planes of 2- and 1-bit fields (int2, int3): every plane's fields gathered into one code byte per channel by table
   (planes after the first shifted to their bit, or-ed in), then 8 channels per pass to float minus the offset -- or,
   for a codebook of at most 8 levels, straight to its levels by one register permute. 0: not this layout (or D not a
   multiple of 8). */
static inline int small_fields(const Fmt *f, const uint8_t *restrict row, int64_t D, const float *restrict cb, float *restrict x) {
    if ((D & 7) || f->signed_bytes || (cb && f->levels > 8)) return 0;
    for (int64_t p = 0; p < f->n_planes; p++)
        if (f->per[p] != 4 && f->per[p] != 8) return 0;
    uint8_t codes[MAX_HEAD_DIM];
    for (int64_t p = 0; p < f->n_planes; p++) {
        const uint8_t *restrict bytes = row + f->byte_off[p];
        const int low = (int)f->low[p];
        if (f->per[p] == 4)
            for (int64_t j = 0; j < D / 4; j++) {
                uint32_t v = FIELDS2[bytes[j]] << low, o;
                if (p) { memcpy(&o, codes + 4 * j, 4); v |= o; }
                memcpy(codes + 4 * j, &v, 4);
            }
        else
            for (int64_t j = 0; j < D / 8; j++) {
                uint64_t v = FIELDS1[bytes[j]] << low, o;
                if (p) { memcpy(&o, codes + 8 * j, 8); v |= o; }
                memcpy(codes + 8 * j, &v, 8);
            }
    }
    if (cb) {
        float book[8] = {0};
        memcpy(book, cb, (size_t)f->levels * sizeof(float));
        const __m256 levels = _mm256_loadu_ps(book);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(x + d, _mm256_permutevar8x32_ps(levels, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d)))));
        return 1;
    }
    const __m256 off = _mm256_set1_ps(f->offset);
    for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(x + d, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d)))), off));
    return 1;
}
#else
static inline int nibbles(const uint8_t *restrict bytes, float offset, int64_t D, float *restrict x) { return 0; }
static inline int small_fields(const Fmt *f, const uint8_t *restrict row, int64_t D, const float *restrict cb, float *restrict x) { return 0; }
static inline int small_fields_rows(const Fmt *f, const uint8_t *restrict data, int64_t rows, int64_t D, const float *restrict cb,
                                    float *restrict out) { return 0; }
#define NIBBLES(f) 0
#endif

static inline void lin_row(const Fmt *f, const uint8_t *restrict row, int64_t D, float *restrict x) {
    if (NIBBLES(f) && nibbles(row + f->byte_off[0], f->offset, D, x)) return;
    if (f->signed_bytes) {  /* int8 stored signed: one plane of whole bytes */
        const int8_t *restrict r = (const int8_t *)row;
        for (int64_t d = 0; d < D; d++) x[d] = (float)r[d] - f->offset;
        return;
    }
    for (int64_t p = 0; p < f->n_planes; p++) {
        const uint8_t *bytes = row + f->byte_off[p];
        switch (f->per[p]) {
        case 1: lin_plane1(bytes, f->low[p], p > 0, D, x); break;
        case 2: lin_plane2(bytes, f->low[p], p > 0, D, x); break;
        case 4: lin_plane4(bytes, f->low[p], p > 0, D, x); break;
        case 8: lin_plane8(bytes, f->low[p], p > 0, D, x); break;
        }
    }
    if (f->offset != 0.0f)
        for (int64_t d = 0; d < D; d++) x[d] -= f->offset;
}

/* allocB rows (KIND_CHANNELS), code by code: each from a 32-bit load at its byte (a gather the compiler may vectorize).
   The rows of a block are contiguous, so a row with at least 3 bytes and a row after it may read up to 3 bytes past its
   end (masked off); the block's last row (and rows under 3 bytes) read byte by byte, their own last byte standing in. */
static void channel_rows(const Fmt *f, const int32_t *restrict off, const int32_t *restrict mask, const uint8_t *restrict data,
                         float *restrict out) {
    const int64_t D = f->head_dim, bs = f->block_size, rb = f->row_bytes, last = rb - 1;
    int32_t at[MAX_HEAD_DIM], sh[MAX_HEAD_DIM];
    for (int64_t d = 0; d < D; d++) at[d] = off[d] >> 3, sh[d] = off[d] & 7;
    const int64_t wide = rb >= 3 ? bs - 1 : 0;
    for (int64_t t = 0; t < wide; t++) {
        const uint8_t *restrict row = data + t * rb;
        float *restrict x = out + t * D;
        for (int64_t d = 0; d < D; d++) {
            uint32_t word;
            __builtin_memcpy(&word, row + at[d], sizeof word);  /* little-endian: byte at[d] lowest */
            x[d] = (float)((word >> sh[d]) & (uint32_t)mask[d]);
        }
    }
    for (int64_t t = wide; t < bs - 1; t++) {
        const uint8_t *restrict row = data + t * rb;
        float *restrict x = out + t * D;
        for (int64_t d = 0; d < D; d++) {
            const uint32_t pair = (uint32_t)row[at[d]] | ((uint32_t)row[at[d] + 1] << 8);  /* the next row's byte at most */
            x[d] = (float)((pair >> sh[d]) & (uint32_t)mask[d]);
        }
    }
    const uint8_t *restrict row = data + (bs - 1) * rb;
    float *restrict x = out + (bs - 1) * D;
    for (int64_t d = 0; d < D; d++) {
        const int32_t byte = at[d];
        const uint32_t pair = (uint32_t)row[byte] | ((uint32_t)row[byte < last ? byte + 1 : last] << 8);
        x[d] = (float)((pair >> sh[d]) & (uint32_t)mask[d]);
    }
}

#if defined(__AVX2__)
/* allocB rows by vectors of 8 channels: channels are packed in their own order (formats.channel_offsets), so a chunk's
   codes lie within 9 bytes of its first code's byte -- one 16-byte load there (in both halves of a vector), a byte
   shuffle that puts each code's byte pair in its 32-bit lane, a shift per lane and a mask give 8 codes. A plan holds
   one head's shuffles, shifts and masks. */
typedef struct {
    int64_t chunks, reach;  /* D / 8; the farthest chunk start (rows whose loads would pass the block: plan_tail) */
    int32_t start[MAX_HEAD_DIM / 8];
    __m256i shuf[MAX_HEAD_DIM / 8], shift[MAX_HEAD_DIM / 8], keep[MAX_HEAD_DIM / 8];
} ChunkPlan;

/* The plan of head offsets off / masks mask [D]; 0 where head_dim is not a multiple of 8 or a chunk's codes lie
   farther apart (not a layout the packer writes). */
static int chunk_plan(const Fmt *f, const int32_t *restrict off, const int32_t *restrict mask, ChunkPlan *restrict p) {
    const int64_t D = f->head_dim;
    if (D % 8) return 0;
    p->chunks = D / 8, p->reach = 0;
    for (int64_t k = 0; k < p->chunks; k++) {
        const int32_t *o = off + 8 * k, *m = mask + 8 * k;
        int32_t first = 0, sh[8];
        uint32_t ctl[8];
        for (int i = 7; i >= 0; i--)
            if (m[i]) first = o[i] >> 3;  /* the chunk's first code's byte (a 0-width channel has no byte) */
        for (int i = 0; i < 8; i++) {
            const int32_t rel = (o[i] >> 3) - first;
            if (!m[i]) {
                ctl[i] = 0x80808080u, sh[i] = 0;  /* pshufb: 0x80 selects a zero byte */
                continue;
            }
            if (rel < 0 || rel > 14) return 0;
            ctl[i] = (uint32_t)rel | (uint32_t)(rel + 1) << 8 | 0x80800000u, sh[i] = o[i] & 7;
        }
        p->start[k] = first, p->reach = first > p->reach ? first : p->reach;
        p->shuf[k] = _mm256_loadu_si256((const __m256i *)ctl);
        p->shift[k] = _mm256_loadu_si256((const __m256i *)sh);
        p->keep[k] = _mm256_loadu_si256((const __m256i *)m);
    }
    return 1;
}

/* How many rows of a block of bs rows at data load within it (row t's loads reach byte t * rb + reach + 15); the others
   are copied into pad [2 * MAX_HEAD_DIM + 32] (less than 2 rows and 16 bytes), 16 zero bytes after them. */
static inline int64_t plan_tail(const ChunkPlan *p, const uint8_t *data, int64_t rb, int64_t bs, uint8_t *pad) {
    const int64_t safe = bs * rb < p->reach + 16 ? 0 : (bs * rb - p->reach - 16) / rb + 1 < bs ? (bs * rb - p->reach - 16) / rb + 1 : bs;
    memcpy(pad, data + safe * rb, (size_t)((bs - safe) * rb));
    memset(pad + (bs - safe) * rb, 0, 16);
    return safe;
}

/* Row t of the block at data, or its copy in pad (plan_tail's). */
static inline const uint8_t *plan_row(const uint8_t *data, const uint8_t *pad, int64_t t, int64_t safe, int64_t rb) {
    return t < safe ? data + t * rb : pad + (t - safe) * rb;
}

/* Chunk k's 8 codes of one row as floats. */
static inline __attribute__((always_inline)) v8f chunk_codes(const uint8_t *restrict row, int32_t start, __m256i shuf, __m256i shift, __m256i keep) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + start)));
    return (v8f)_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, shuf), shift), keep));
}

/* The codes of one row as vectors x[0 .. chunks), times sf plus zf (per channel, as vectors) where sf is given. */
static inline __attribute__((always_inline)) void plan_decode(const ChunkPlan *restrict p, const uint8_t *restrict row, const v8f *restrict sf,
                                                              const v8f *restrict zf, v8f *restrict x) {
    for (int64_t k = 0; k < p->chunks; k++) {
        const v8f v = chunk_codes(row, p->start[k], p->shuf[k], p->shift[k], p->keep[k]);
        x[k] = sf ? v * sf[k] + zf[k] : v;
    }
}

/* A block's rows (codes times the block's per-channel scale sf plus zf where given: one pass instead of two) into out
   [bs, D]; 0, having written nothing, where there is no plan. */
static int channel_rows_simd(const Fmt *f, const int32_t *restrict off, const int32_t *restrict mask, const uint8_t *restrict data,
                             const float *restrict sf, const float *restrict zf, float *restrict out) {
    const int64_t D = f->head_dim, bs = f->block_size, rb = f->row_bytes;
    ChunkPlan p;
    if (!chunk_plan(f, off, mask, &p)) return 0;
    v8f s[MAX_HEAD_DIM / 8], z[MAX_HEAD_DIM / 8], x[MAX_HEAD_DIM / 8];
    for (int64_t k = 0; sf && k < p.chunks; k++) s[k] = load8(sf + 8 * k), z[k] = load8(zf + 8 * k);
    uint8_t pad[2 * MAX_HEAD_DIM + 32];
    const int64_t safe = plan_tail(&p, data, rb, bs, pad);
    for (int64_t t = 0; t < bs; t++) {
        plan_decode(&p, plan_row(data, pad, t, safe, rb), sf ? s : 0, z, x);
        for (int64_t k = 0; k < p.chunks; k++) store8(out + t * D + 8 * k, x[k]);
    }
    return 1;
}
#define HAVE_CHUNK_PLAN 1
#else
#define HAVE_CHUNK_PLAN 0
static int channel_rows_simd(const Fmt *f, const int32_t *restrict off, const int32_t *restrict mask, const uint8_t *restrict data,
                             const float *restrict sf, const float *restrict zf, float *restrict out) { return 0; }
#endif

/* Column j of sequence b: its bs rows' codes as floats (the dtype's offset taken off, no scale yet; a nuq format's
   codes replaced by their codebook levels) into out [bs, D]; fp16 rows are their values. */
static inline void decode_codes(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) {
    const int64_t D = f->head_dim, H = f->num_heads, bs = f->block_size, blk = c->tables[b * c->cols + j], bh = blk * H + h;
    const uint8_t *data = c->data + bh * bs * f->row_bytes;
    if (f->kind == KIND_FP16) {
        half_to_float((const half *)data, out, bs * D);
        return;
    }
    if (f->kind == KIND_CHANNELS) {
        const int32_t *restrict off = f->chan_off + h * D, *restrict mask = f->chan_mask + h * D;
        if (!channel_rows_simd(f, off, mask, data, 0, 0, out)) channel_rows(f, off, mask, data, out);
        return;
    }
    const float *restrict cb = f->codebook ? f->codebook + (f->codebook_heads > 1 ? h * f->levels : 0) : 0;
    int looked_up = 0;  /* the codebook applied by the row decoder */
    const int small = f->linear && !NIBBLES(f);  /* int4's nibbles keep their own path (lin_row) */
    if (small && small_fields_rows(f, data, bs, D, cb, out)) return;  /* the codebook applied too */
    for (int64_t t = 0; t < bs; t++) {
        if (f->linear) {
            if (small && small_fields(f, data + t * f->row_bytes, D, cb, out + t * D)) {
                looked_up = cb != 0;
                continue;
            }
            lin_row(f, data + t * f->row_bytes, D, out + t * D);
            continue;
        }
        for (int64_t p = 0; p < f->n_planes; p++)
            lut_plane(data + t * f->row_bytes + f->byte_off[p], f->table[p], f->per[p], p > 0, D, out + t * D);
    }
    if (cb && !looked_up) {  /* the codes are table indices 0 .. levels - 1 (unsigned: no offset) */
        const int64_t top = f->levels - 1;
        for (int64_t i = 0; i < bs * D; i++) {
            const int64_t k = (int64_t)out[i];
            out[i] = cb[k < 0 ? 0 : k > top ? top : k];
        }
    }
}

/* The block's per-channel scale and zero-point (per_block_channel: converted once per block; zf zeros when symmetric). */
static void block_channel(const Ctx *c, int64_t bh, int64_t D, float *restrict sf, float *restrict zf) {
    half_to_float(c->scale + bh * D, sf, D);
    if (c->zero) half_to_float(c->zero + bh * D, zf, D);
    else memset(zf, 0, (size_t)D * sizeof(float));
}

/* One scale and zero-point per channel for a block (per_block_channel: the block's; static: head h's, zero 0): the
   granularities whose scales fold into a query or onto a block's sum. */
static inline void channel_scales(const Fmt *f, const Ctx *c, int64_t bh, int64_t h, float *restrict sf, float *restrict zf) {
    const int64_t D = f->head_dim;
    if (f->gran == GRAN_BLOCK_CHANNEL) {
        block_channel(c, bh, D, sf, zf);
        return;
    }
    memcpy(sf, f->static_scale + h * D, (size_t)D * sizeof(float));
    memset(zf, 0, (size_t)D * sizeof(float));
}

#if defined(__AVX2__)
#include <immintrin.h>
/* The 8-point Sylvester transform of one vector (butterflies of strides 1, 2 and 4: (a + b, a - b) by a lane permute
   and a sign). */
static inline v8f hadamard8(v8f x) {
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    __m256 v = (__m256)x;
    v = _mm256_add_ps(_mm256_mul_ps(v, s1), _mm256_permute_ps(v, 0xB1));
    v = _mm256_add_ps(_mm256_mul_ps(v, s2), _mm256_permute_ps(v, 0x4E));
    v = _mm256_add_ps(_mm256_mul_ps(v, s4), _mm256_permute2f128_ps(v, v, 1));
    return (v8f)v;
}
#define HAVE_HADAMARD8 1
#else
#define HAVE_HADAMARD8 0
static inline v8f hadamard8(v8f x) { return x; }
#endif

/* x <- x @ H unnormalized, for one row: H the block-diagonal Sylvester matrix of trtkv.quant.hadamard_matrix (blocks
   of hb, the largest power of two dividing D; symmetric, so this is also x @ H^T), by butterflies -- D log hb adds
   instead of the D * D of a product with the matrix. The caller multiplies by 1 / sqrt(hb). */
static inline void hadamard_row(float *restrict x, int64_t D) {
    const int64_t hb = D & -D;
    int64_t s = 1;
    if (HAVE_HADAMARD8 && hb >= 8) {
        for (int64_t d = 0; d < D; d += 8) store8(x + d, hadamard8(load8(x + d)));
        s = 8;
    }
    for (; s < hb; s <<= 1)
        for (int64_t i = 0; i < D; i += 2 * s)  /* groups of 2s never straddle a block: 2s <= hb divides D */
            for (int64_t k = i; k < i + s; k++) {
                const float a = x[k], b = x[k + s];
                x[k] = a + b, x[k + s] = a - b;
            }
}

/* One row in vectors x[0 .. V) (D = 8 V, V even) from stored to model space in place -- trtkv.quant.inverse_transform:
   the rotation undone (x @ H^T, butterflies of strides >= 8 between vectors), times m (the smoothing factors and the
   rotation's 1 / sqrt(hb)), then for keys stored before RoPE (cs / sn: that position's table rows; NULL: none) RoPE
   at the row's position (rotate-half layout, trtkv.rope.rotate: k = x * cos + rotate_half(x) * sin). */
static inline __attribute__((always_inline)) void model_space_vectors(const Fmt *f, v8f *restrict x, const v8f *restrict m, int64_t V, const float *restrict cs,
                                       const float *restrict sn, int64_t hoff) {
    const int64_t hv = V / 2, hbv = (8 * V & -(8 * V)) / 8;
    if (f->rot) {
#pragma GCC unroll 32
        for (int64_t v = 0; v < V; v++) x[v] = hadamard8(x[v]);
#pragma GCC unroll 8
        for (int64_t s = 1; s < hbv; s <<= 1)
#pragma GCC unroll 32
            for (int64_t i = 0; i < V; i += 2 * s)
#pragma GCC unroll 32
                for (int64_t k = i; k < i + s; k++) {
                    const v8f a = x[k], e = x[k + s];
                    x[k] = a + e, x[k + s] = a - e;
                }
    }
    if (!cs) {
#pragma GCC unroll 32
        for (int64_t v = 0; v < V; v++) x[v] *= m[v];
        return;
    }
#pragma GCC unroll 16
    for (int64_t v = 0; v < hv; v++) {
        const v8f lo = x[v] * m[v], hi = x[v + hv] * m[v + hv];
        const v8f c_lo = load8(cs + 8 * v), s_lo = load8(sn + 8 * v);
        x[v] = lo * c_lo - hi * s_lo;
        x[v + hv] = hi * (hoff ? load8(cs + hoff + 8 * v) : c_lo) + lo * (hoff ? load8(sn + hoff + 8 * v) : s_lo);
    }
}

/* Whether model_space_vectors serves format f: whole vectors in each half of a row, and (rotated) blocks of 8 or more
   for the in-vector butterflies. */
static inline int vector_model_space(const Fmt *f) {
    const int64_t D = f->head_dim;
    return D % 16 == 0 && (!f->rot || (HAVE_HADAMARD8 && (D & -D) >= 8));
}

/* The butterflies' normalization: 1 / sqrt(hb) of a rotated format (blocks of hb = D & -D), else 1. */
static inline float rotation_norm(const Fmt *f) { return f->rot ? 1.0f / sqrtf((float)(f->head_dim & -f->head_dim)) : 1.0f; }

/* m of model_space_vectors for head h: the smoothing factors times the rotation's 1 / sqrt(hb). */
static inline __attribute__((always_inline)) void model_space_factors(const Fmt *f, int64_t h, v8f *restrict m) {
    const int64_t D = f->head_dim;
    const float norm = rotation_norm(f);
    for (int64_t v = 0; v < D / 8; v++) {
        m[v] = (v8f){0} + norm;
        if (f->smooth) m[v] *= load8(f->smooth + h * D + 8 * v);
    }
}

/* rows_to_model_space's vector path: V = D / 8, a constant where inlined (the row stays in registers). */
static inline __attribute__((always_inline)) void model_space_rows(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j,
                                                                   float *restrict out, const int64_t V) {
    const int64_t D = 8 * V, bs = f->block_size, p0 = f->pre_rope ? c->first_pos[b] + j * bs : 0;
    v8f m[MAX_HEAD_DIM / 8], x[MAX_HEAD_DIM / 8];
    model_space_factors(f, h, m);
    for (int64_t t = 0; t < bs; t++) {
        float *restrict r = out + t * D;
        for (int64_t v = 0; v < V; v++) x[v] = load8(r + 8 * v);
        if (f->pre_rope)
            model_space_vectors(f, x, m, V, c->rope_cos + (p0 + t) * c->rope_stride, c->rope_sin + (p0 + t) * c->rope_stride, c->rope_hoff);
        else model_space_vectors(f, x, m, V, 0, 0, 0);
        for (int64_t v = 0; v < V; v++) store8(r + 8 * v, x[v]);
    }
}

/* The decoded rows of column j of sequence b [bs, D] (stored space) back in model space: the rotation and smoothing
   undone, and keys stored before RoPE rotated at their positions. */
static void rows_to_model_space(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) {
    const int64_t D = f->head_dim, bs = f->block_size, half_d = D / 2;
    if (vector_model_space(f)) {
        switch (D) {  /* the common head sizes as constants */
        case 64: model_space_rows(f, c, b, h, j, out, 8); break;
        case 128: model_space_rows(f, c, b, h, j, out, 16); break;
        default: model_space_rows(f, c, b, h, j, out, D / 8);
        }
        return;
    }
    float m[MAX_HEAD_DIM], x[MAX_HEAD_DIM];
    const float norm = rotation_norm(f);
    const int64_t p0 = f->pre_rope ? c->first_pos[b] + j * bs : 0;
    for (int64_t d = 0; d < D; d++) m[d] = (f->smooth ? f->smooth[h * D + d] : 1.0f) * norm;
    for (int64_t t = 0; t < bs; t++) {
        float *restrict r = out + t * D;
        if (f->rot) hadamard_row(r, D);
        if (!f->pre_rope) {
            for (int64_t d = 0; d < D; d++) r[d] *= m[d];
            continue;
        }
        for (int64_t d = 0; d < D; d++) x[d] = r[d] * m[d];
        const float *restrict cs = c->rope_cos + (p0 + t) * c->rope_stride, *restrict sn = c->rope_sin + (p0 + t) * c->rope_stride;
        const float *restrict cs_hi = cs + c->rope_hoff - half_d, *restrict sn_hi = sn + c->rope_hoff - half_d;  /* at d >= D / 2 */
        for (int64_t d = 0; d < half_d; d++) r[d] = x[d] * cs[d] - x[d + half_d] * sn[d];
        for (int64_t d = half_d; d < D; d++) r[d] = x[d] * cs_hi[d] + x[d - half_d] * sn_hi[d];
    }
}

#if HAVE_CHUNK_PLAN
/* What channel_model_block holds in registers for one RoPE pair of chunks (v and v + D / 16): their shuffles, shifts,
   masks and first bytes, and their scales and zero-points times the model-space factors. */
typedef struct {
    __m256i shuf[2], shift[2], keep[2];
    int32_t start[2];
    v8f s[2], z[2];
} RopePair;

static inline __attribute__((always_inline)) RopePair rope_pair(const ChunkPlan *p, const float *sf, const float *zf, const v8f *m, int64_t v,
                                                                int64_t hv) {
    RopePair r;
    for (int i = 0; i < 2; i++) {
        const int64_t k = v + i * hv;
        r.shuf[i] = p->shuf[k], r.shift[i] = p->shift[k], r.keep[i] = p->keep[k], r.start[i] = p->start[k];
        r.s[i] = load8(sf + 8 * k) * m[k], r.z[i] = load8(zf + 8 * k) * m[k];
    }
    return r;
}

/* Rows t0 .. t1 - 1 (row t's bytes at rows + (t - t0) * rb) of n pairs from chunk v: decoded, scaled, rotated at
   their positions (cos0 / sin0: the block's first row of the table; rotate-half: k = x * cos + rotate_half(x) * sin),
   stored into out [bs, D]. */
static inline __attribute__((always_inline)) void rope_pair_rows(const RopePair *restrict pr, int n, const uint8_t *restrict rows, int64_t rb,
                                                                 int64_t t0, int64_t t1, const float *restrict cos0, const float *restrict sin0,
                                                                 int64_t stride, int64_t hoff, int64_t v, int64_t hv, int64_t D,
                                                                 float *restrict out) {
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *restrict row = rows + (t - t0) * rb;
        const float *restrict cs = cos0 + t * stride, *restrict sn = sin0 + t * stride;
        for (int i = 0; i < n; i++) {
            const RopePair *q = pr + i;
            const int64_t lo_at = 8 * (v + i), hi_at = 8 * (v + i + hv);
            const v8f lo = chunk_codes(row, q->start[0], q->shuf[0], q->shift[0], q->keep[0]) * q->s[0] + q->z[0];
            const v8f hi = chunk_codes(row, q->start[1], q->shuf[1], q->shift[1], q->keep[1]) * q->s[1] + q->z[1];
            const v8f c_lo = load8(cs + lo_at), s_lo = load8(sn + lo_at);  /* hoff 0 (equal halves): the same for both */
            store8(out + t * D + lo_at, lo * c_lo - hi * s_lo);
            store8(out + t * D + hi_at, hi * (hoff ? load8(cs + hoff + lo_at) : c_lo) + lo * (hoff ? load8(sn + hoff + lo_at) : s_lo));
        }
    }
}

/* Column j of sequence b (held[b] > j) of allocB keys stored before RoPE, in model space [bs, D], by vectors: two RoPE
   pairs of chunks at a time (channels c and c + D / 2 are rotated together), down the block's rows -- each row's chunks
   decoded, scaled (the smoothing factors folded into the block's scales) and rotated at its position in one pass, the
   pairs' constants in registers (rope_pair_rows); the rows whose loads would pass the block read from a padded copy. Then each outlier as a correction of its rotated row: RoPE is linear, so the kept value minus what its code
   decodes to, rotated, adds to the two channels of its pair. 0, having written nothing, where this does not serve f. */
static int channel_model_block(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) {
    const int64_t D = f->head_dim, bs = f->block_size, rb = f->row_bytes, V = D / 8, hv = V / 2, half_d = D / 2;
    if (f->kind != KIND_CHANNELS || f->gran != GRAN_BLOCK_CHANNEL || !f->pre_rope || f->rot || !vector_model_space(f)) return 0;
    const int32_t *restrict off = f->chan_off + h * D, *restrict mask = f->chan_mask + h * D;
    ChunkPlan p;
    if (!chunk_plan(f, off, mask, &p)) return 0;
    const int64_t bh = c->tables[b * c->cols + j] * f->num_heads + h, p0 = c->first_pos[b] + j * bs;
    const uint8_t *data = c->data + bh * bs * rb;
    float sf[MAX_HEAD_DIM], zf[MAX_HEAD_DIM];
    block_channel(c, bh, D, sf, zf);
    v8f m[MAX_HEAD_DIM / 8];
    model_space_factors(f, h, m);
    uint8_t pad[2 * MAX_HEAD_DIM + 32];
    const int64_t safe = plan_tail(&p, data, rb, bs, pad);
    const int64_t stride = c->rope_stride, hoff = c->rope_hoff;
    const float *restrict cos0 = c->rope_cos + p0 * stride, *restrict sin0 = c->rope_sin + p0 * stride;
    int64_t v = 0;
    for (; v + 2 <= hv; v += 2) {  /* two pairs: whole cache lines of the rows written per pass */
        const RopePair two[2] = {rope_pair(&p, sf, zf, m, v, hv), rope_pair(&p, sf, zf, m, v + 1, hv)};
        if (hoff) {
            rope_pair_rows(two, 2, data, rb, 0, safe, cos0, sin0, stride, hoff, v, hv, D, out);
            rope_pair_rows(two, 2, pad, rb, safe, bs, cos0, sin0, stride, hoff, v, hv, D, out);
        } else {  /* equal halves: one table load for both */
            rope_pair_rows(two, 2, data, rb, 0, safe, cos0, sin0, stride, 0, v, hv, D, out);
            rope_pair_rows(two, 2, pad, rb, safe, bs, cos0, sin0, stride, 0, v, hv, D, out);
        }
    }
    for (; v < hv; v++) {
        const RopePair one[1] = {rope_pair(&p, sf, zf, m, v, hv)};
        rope_pair_rows(one, 1, data, rb, 0, safe, cos0, sin0, stride, hoff, v, hv, D, out);
        rope_pair_rows(one, 1, pad, rb, safe, bs, cos0, sin0, stride, hoff, v, hv, D, out);
    }
    const int16_t *ix = f->outliers ? c->oidx + bh * f->outliers : 0;
    const half *ov = f->outliers ? c->oval + bh * f->outliers : 0;
    for (int64_t k = 0; k < f->outliers; k++) {
        const int64_t at = ix[k], t = at / D, e = at % D;
        if (at < 0 || at >= bs * D) continue;  /* a position outside the block is never written */
        const uint8_t *row = data + t * rb;
        const int32_t byte = off[e] >> 3;
        const uint32_t pair = (uint32_t)row[byte] | ((uint32_t)row[byte < rb - 1 ? byte + 1 : rb - 1] << 8);
        const float coded = (float)((pair >> (off[e] & 7)) & (uint32_t)mask[e]) * sf[e] + zf[e];
        const float delta = ((float)ov[k] - coded) * m[e / 8][e % 8];
        const float *restrict cs = c->rope_cos + (p0 + t) * stride, *restrict sn = c->rope_sin + (p0 + t) * stride;
        float *restrict r = out + t * D;
        if (e < half_d) {  /* channel e pairs with e + D / 2, whose table entries sit at hoff + e */
            r[e] += delta * cs[e];
            r[e + half_d] += delta * sn[hoff + e];
        } else {
            r[e] += delta * cs[hoff + e - half_d];
            r[e - half_d] -= delta * sn[e - half_d];
        }
    }
    return 1;
}
#else
static int channel_model_block(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) { return 0; }
#endif

/* Column j of sequence b (held[b] > j): its bs rows' values in stored space into out [bs, D] -- the codes decoded and
   scaled, the block's outliers written over them. */
static inline void stored_block(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) {
    const int64_t D = f->head_dim, H = f->num_heads, bs = f->block_size, blk = c->tables[b * c->cols + j], bh = blk * H + h;
    int scaled = 0;  /* allocB rows, by vectors: decoded and scaled in one pass */
    if (f->kind == KIND_CHANNELS && f->gran == GRAN_BLOCK_CHANNEL) {
        float sf[MAX_HEAD_DIM], zf[MAX_HEAD_DIM];
        block_channel(c, bh, D, sf, zf);
        scaled = channel_rows_simd(f, f->chan_off + h * D, f->chan_mask + h * D, c->data + bh * bs * f->row_bytes, sf, zf, out);
    }
    if (!scaled) decode_codes(f, c, b, h, j, out);
    if (!scaled && f->kind != KIND_FP16) {
        if (f->gran == GRAN_STATIC) {
            const float *restrict sc = f->static_scale + h * D;
            for (int64_t t = 0; t < bs; t++)
                for (int64_t d = 0; d < D; d++) out[t * D + d] *= sc[d];
        } else if (f->gran == GRAN_BLOCK_CHANNEL) {
            float sf[MAX_HEAD_DIM], zf[MAX_HEAD_DIM];
            block_channel(c, bh, D, sf, zf);
            for (int64_t t = 0; t < bs; t++)
                for (int64_t d = 0; d < D; d++) out[t * D + d] = out[t * D + d] * sf[d] + zf[d];
        } else if (f->gran == GRAN_TOKEN) {
            const int64_t G = f->groups, g = D / G;
            for (int64_t t = 0; t < bs; t++) {
                const half *sp = c->scale + (bh * bs + t) * G;
                const half *zp = c->zero ? c->zero + (bh * bs + t) * G : 0;
                for (int64_t k = 0; k < G; k++) {
                    const float sk = (float)sp[k], zk = zp ? (float)zp[k] : 0.0f;
                    float *restrict x = out + t * D + k * g;
                    for (int64_t d = 0; d < g; d++) x[d] = x[d] * sk + zk;
                }
            }
        }
    }
    if (f->outliers) {
        const int16_t *ix = c->oidx + bh * f->outliers;
        const half *ov = c->oval + bh * f->outliers;
        for (int64_t k = 0; k < f->outliers; k++)
            if (ix[k] >= 0 && ix[k] < bs * D) out[ix[k]] = (float)ov[k];  /* a position outside the block is never written */
    }
}

/* Column j of sequence b (held[b] > j): its bs rows decoded into out [bs, D] -- stored space, or model space for keys
   stored before RoPE -- the block's outliers written over the codes' values, the sink rows in place (in the rows'
   space). */
static inline void decode_block(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) {
    const int64_t D = f->head_dim, H = f->num_heads;
    if (!channel_model_block(f, c, b, h, j, out)) {
        stored_block(f, c, b, h, j, out);
        if (f->pre_rope) rows_to_model_space(f, c, b, h, j, out);
    }
    if (j == 0 && c->sink && (!c->sink_ok || c->sink_ok[b]))
        memcpy(out, c->sink + (b * H + h) * c->sink_tokens * D, (size_t)(c->sink_tokens * D) * sizeof(float));
}

/* Column j of sequence b (held[b] > j) in model space [bs, D] (trtkv_dequant): decode_block's rows with every
   transform undone, the sink rows (model space) in place. */
static inline void model_block(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, float *restrict out) {
    const int64_t D = f->head_dim, H = f->num_heads;
    if (!channel_model_block(f, c, b, h, j, out)) {
        stored_block(f, c, b, h, j, out);
        if (f->pre_rope || f->rot || f->smooth) rows_to_model_space(f, c, b, h, j, out);
    }
    if (j == 0 && c->sink && (!c->sink_ok || c->sink_ok[b]))
        memcpy(out, c->sink + (b * H + h) * c->sink_tokens * D, (size_t)(c->sink_tokens * D) * sizeof(float));
}

/* Whether what format f's reads need is there: outlier lists, and a RoPE table covering every position read. */
static int reads_ok(const Fmt *f, const Ctx *c) {
    if (f->outliers && (!c->oidx || !c->oval)) return 0;
    if (!f->pre_rope) return 1;
    if (!c->rope_cos || !c->rope_sin || !c->first_pos || (f->head_dim & 1)) return 0;
    for (int64_t b = 0; b < c->batch; b++) {
        const int64_t held = c->held[b] < c->nb ? c->held[b] : c->nb;
        if (held > 0 && (c->first_pos[b] < 0 || c->first_pos[b] + held * f->block_size > c->rope_rows)) return 0;
    }
    return 1;
}

int64_t trtkv_dequant(const Fmt *f, const Ctx *c, float *out, int64_t out_rows, int64_t threads) {
    const int64_t H = f->num_heads, D = f->head_dim, bs = f->block_size, nb = c->nb, pairs = c->batch * H;
    if (D > MAX_HEAD_DIM || out_rows < nb * bs || !reads_ok(f, c)) return -1;
    int64_t T = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (T > pairs) T = pairs < 1 ? 1 : pairs;
    /* [B, H] pairs over torch's OpenMP pool (each writes its own rows) */
    #pragma omp parallel for num_threads(T) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t b = p / H, h = p % H;
        float *o = out + p * out_rows * D;
        for (int64_t j = 0; j < nb; j++) {
            if (j < c->held[b]) model_block(f, c, b, h, j, o + j * bs * D);
            else memset(o + j * bs * D, 0, (size_t)(bs * D) * sizeof(float));
        }
    }
    return 0;
}

/* out[i * os + d] += sum_t p[i * ps + t] * rows[t * rs + d] for d < W, over ``m`` rows, for the n queries: d in chunks of 8,
   a register accumulator per (chunk, query), so the output is loaded and stored once per block instead of once per row. */
static inline __attribute__((always_inline)) void accumulate_cols(float *restrict out, int64_t os, const float *restrict p, int64_t ps, const float *restrict rows,
                                   int64_t rs, int64_t m, int64_t n, int64_t W) {
    int64_t d0 = 0;
    for (; d0 + 8 <= W; d0 += 8)
        for (int64_t i = 0; i < n; i++) {
            const float *restrict pi = p + i * ps;
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};  /* four independent chains: the adds do not wait on each other */
            int64_t t = 0;
            for (; t + 4 <= m; t += 4) {
                a0 += pi[t] * load8(rows + t * rs + d0);
                a1 += pi[t + 1] * load8(rows + (t + 1) * rs + d0);
                a2 += pi[t + 2] * load8(rows + (t + 2) * rs + d0);
                a3 += pi[t + 3] * load8(rows + (t + 3) * rs + d0);
            }
            for (; t < m; t++) a0 += pi[t] * load8(rows + t * rs + d0);
            store8(out + i * os + d0, load8(out + i * os + d0) + ((a0 + a1) + (a2 + a3)));
        }
    for (; d0 < W; d0++)
        for (int64_t i = 0; i < n; i++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < m; t++) acc += p[i * ps + t] * rows[t * rs + d0];
            out[i * os + d0] += acc;
        }
}

/* out[i, :] += sum_t p[i * ps + t] * rows[t, :] over ``m`` rows of D floats. */
static inline void accumulate(float *restrict out, const float *restrict p, int64_t ps, const float *restrict rows, int64_t m,
                              int64_t n, int64_t D) {
    accumulate_cols(out, D, p, ps, rows, D, m, n, D);
}

#if defined(__AVX__)
/* The 8 sums of a[0 .. 8) as one vector, by a tree of horizontal adds (a per-row hsum8 was most of a dot's time). */
static inline v8f sums8(const v8f *restrict a) {
    const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#define HAVE_SUMS8 1
#else
#define HAVE_SUMS8 0
static inline v8f sums8(const v8f *restrict a) { return a[0]; }
#endif

/* s[i * ss + t] = q[i, :] . rows[t, :] for m rows, n queries: 8 rows at a time per query, their sums reduced together. */
static inline void dots(float *restrict s, int64_t ss, const float *restrict q, const float *restrict rows, int64_t m, int64_t n, int64_t D) {
    const int64_t D8 = D & ~(int64_t)7;
    int64_t t = 0;
    if (HAVE_SUMS8 && D8 == D)
        for (; t + 8 <= m; t += 8)
            for (int64_t i = 0; i < n; i++) {
                const float *restrict qi = q + i * D;
                v8f acc[8] = {{0}};
                for (int64_t d = 0; d < D; d += 8) {
                    const v8f qv = load8(qi + d);
                    for (int64_t k = 0; k < 8; k++) acc[k] += qv * load8(rows + (t + k) * D + d);
                }
                store8(s + i * ss + t, sums8(acc));
            }
    for (; t < m; t++) {
        const float *restrict r = rows + t * D;
        for (int64_t i = 0; i < n; i++) {
            const float *restrict qi = q + i * D;
            v8f acc = {0};
            for (int64_t d = 0; d < D8; d += 8) acc += load8(qi + d) * load8(r + d);
            float tot = hsum8(acc);
            for (int64_t d = D8; d < D; d++) tot += qi[d] * r[d];
            s[i * ss + t] = tot;
        }
    }
}

typedef struct {
    int64_t n;                   /* queries per KV head (the GQA group) */
    const float *q, *qf;         /* [B, H, n, D]: model space (open rows, new row), folded into stored space (sealed) */
    const float *new_k, *new_v;  /* [B, H, D] this step's row, model space */
    const half *k_tail, *v_tail; /* [slots, H, tail_rows, D] the open blocks, then the sink rows (model space) */
    int64_t tail_rows;
    const int64_t *slot;         /* [B] */
    const int64_t *open_len;     /* [B] rows of the open block */
    const int64_t *q_pos;        /* [B] the new token's position */
    const int64_t *first_pos;    /* [B] position of sealed column 0, row 0 (a window ring's first block) */
    const int64_t *open_pos;     /* [B] position of open row 0 */
    int64_t sink_tokens;         /* rows of column 0 read from the tail's sink rows (model space, like the open block) */
    const uint8_t *sink_ok;      /* [B] which sequences read them (NULL: every one) */
    int64_t window;              /* 0: none; else keys at pos <= q_pos - window are masked */
    float scaling, softcap;      /* softcap 0: none */
    float *out_sealed, *out_rest;/* [B, H, n, D] */
    int64_t model_space;         /* 1: qf is not read -- the query is folded here by the keys' transforms -- and out_rest is the
                                    whole output, the sealed part transformed back by the values' (out_sealed: scratch) */
    int64_t threads;             /* OpenMP threads the [B, H] pairs are split over (<= 1: the caller's only) */
} Decode;

/* Scratch of one decode call: a block of rows, the folded queries and the scaled probabilities of one block. */
typedef struct {
    float *blk;   /* [max(bs, tail_rows), D] */
    float *qs;    /* [n, D] the query times the block's key scales */
    float *acc;   /* [n, D] one block's unscaled value sums */
    float *ps;    /* [n, bs] the probabilities times one value group's scales */
    float *gs;    /* [2, bs * groups] one block's per-token group scales and zero-points as floats */
    float *bias;  /* [n] the query times the block's key zero-points */
    float *qf;    /* [n, D] the query folded by the keys' transforms (model_space) */
} Scratch;

/* qf[i] = (q[i] * smooth[h]) @ rot: fold(q) . fwd(k) = q . k for k's transforms (orthogonal rot, diagonal smooth). */
static void fold_query(const Fmt *f, int64_t h, const float *restrict q, int64_t n, float *restrict qf) {
    const int64_t D = f->head_dim;
    for (int64_t i = 0; i < n; i++) {
        float x[MAX_HEAD_DIM];
        float *restrict o = qf + i * D;
        for (int64_t d = 0; d < D; d++) x[d] = f->smooth ? q[i * D + d] * f->smooth[h * D + d] : q[i * D + d];
        if (!f->rot) {
            memcpy(o, x, (size_t)D * sizeof(float));
            continue;
        }
        memset(o, 0, (size_t)D * sizeof(float));
        for (int64_t d = 0; d < D; d++) {
            const float c = x[d];
            const float *restrict r = f->rot + d * D;
            for (int64_t e = 0; e < D; e++) o[e] += c * r[e];
        }
    }
}

/* out[i] += (y[i] @ rot^T) * smooth[h]: the values' stored-space sums y back in model space (trtkv.quant.inverse_transform). */
static void unfold_values(const Fmt *f, int64_t h, const float *restrict y, int64_t n, float *restrict out) {
    const int64_t D = f->head_dim;
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d++) {
            float v;
            if (f->rot) dots(&v, 1, y + i * D, f->rot + d * D, 1, 1, D);
            else v = y[i * D + d];
            out[i * D + d] += f->smooth ? v * f->smooth[h * D + d] : v;
        }
}

/* s[i * ss + t] = qf[i] . key row t of column j, for its bs rows. The scale is folded into the query instead of applied
   to the rows (q . (c * s + z) = (q * s) . c + q . z): a per-block-channel or static key scale costs n * D multiplies per
   block instead of bs * D. Per-token scales (and a Ctx with sink rows in it) decode the rows whole. */
static inline void key_scores(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, const float *restrict qf, int64_t n,
                       Scratch *w, float *restrict s, int64_t ss) {
    const int64_t D = f->head_dim, bs = f->block_size, bh = c->tables[b * c->cols + j] * f->num_heads + h;
    if (f->kind == KIND_FP16 || c->sink || f->outliers || f->pre_rope || (f->gran != GRAN_BLOCK_CHANNEL && f->gran != GRAN_STATIC)) {
        decode_block(f, c, b, h, j, w->blk);  /* pre_rope: model-space rows, and qf is the model-space query */
        dots(s, ss, qf, w->blk, bs, n, D);
        return;
    }
    float sf[MAX_HEAD_DIM], zf[MAX_HEAD_DIM], *bias = w->bias;
    channel_scales(f, c, bh, h, sf, zf);
    for (int64_t i = 0; i < n; i++) {
        float z = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            w->qs[i * D + d] = qf[i * D + d] * sf[d];
            z += qf[i * D + d] * zf[d];
        }
        bias[i] = z;
    }
    decode_codes(f, c, b, h, j, w->blk);
    dots(s, ss, w->qs, w->blk, bs, n, D);
    for (int64_t i = 0; i < n; i++)
        for (int64_t t = 0; t < bs; t++) s[i * ss + t] += bias[i];
}

/* A block's value outliers on top of value_accumulate's folded sums: each kept element (row t >= skip, channel d) adds
   p[i, t] * (its value - what its code decodes to), the code's value being rows' entry times its scale plus zero-point
   (per token: that row's group's, gs / gz [m, G] from row skip; else per channel: sf / zf). */
static inline void value_outliers(const Fmt *f, const Ctx *c, int64_t bh, int64_t skip, const float *restrict p, int64_t ps, int64_t n,
                                  const float *restrict blk, const float *restrict gs, const float *restrict gz,
                                  const float *restrict sf, const float *restrict zf, float *restrict out) {
    const int64_t D = f->head_dim, bs = f->block_size, g = gs ? D / f->groups : 0;
    const int16_t *ix = c->oidx + bh * f->outliers;
    const half *ov = c->oval + bh * f->outliers;
    for (int64_t k = 0; k < f->outliers; k++) {
        const int64_t at = ix[k], t = at / D, d = at % D;
        if (at < 0 || at >= bs * D || t < skip) continue;  /* outside the block (never written) or a skipped row */
        const float coded = gs ? blk[at] * gs[(t - skip) * f->groups + d / g] + (gz ? gz[(t - skip) * f->groups + d / g] : 0.0f)
                               : blk[at] * sf[d] + zf[d];
        const float delta = (float)ov[k] - coded;
        for (int64_t i = 0; i < n; i++) out[i * D + d] += p[i * ps + t] * delta;
    }
}

/* out[i, :] += sum over rows t >= skip of column j of p[i * ps + t] * value row t. Scales are folded too: per token
   (groups), into the probabilities, one group's columns at a time (p * s) and the zero-points as sum_t p * z; per block
   channel or static, applied once to the block's sum (s * sum_t p c + z * sum_t p). A block's outliers are corrections
   on top (value_outliers). */
static inline void value_accumulate(const Fmt *f, const Ctx *c, int64_t b, int64_t h, int64_t j, int64_t skip, const float *restrict p,
                             int64_t ps, int64_t n, Scratch *w, float *restrict out) {
    const int64_t D = f->head_dim, bs = f->block_size, m = bs - skip, bh = c->tables[b * c->cols + j] * f->num_heads + h;
    if (f->kind == KIND_FP16 || c->sink || f->gran == GRAN_NONE) {
        decode_block(f, c, b, h, j, w->blk);
        accumulate(out, p + skip, ps, w->blk + skip * D, m, n, D);
        return;
    }
    decode_codes(f, c, b, h, j, w->blk);
    const float *rows = w->blk + skip * D;
    if (f->gran == GRAN_TOKEN) {
        const int64_t G = f->groups, g = D / G;
        float *restrict gs = w->gs, *restrict gz = w->gs + bs * G;  /* the rows' scales / zeros [m, G], converted once */
        half_to_float(c->scale + (bh * bs + skip) * G, gs, m * G);
        if (c->zero) half_to_float(c->zero + (bh * bs + skip) * G, gz, m * G);
        for (int64_t k = 0; k < G; k++) {
            for (int64_t i = 0; i < n; i++) {
                float zsum = 0.0f;
                for (int64_t t = 0; t < m; t++) {
                    w->ps[i * bs + t] = p[i * ps + skip + t] * gs[t * G + k];
                    if (c->zero) zsum += p[i * ps + skip + t] * gz[t * G + k];
                }
                if (c->zero)
                    for (int64_t d = 0; d < g; d++) out[i * D + k * g + d] += zsum;
            }
            accumulate_cols(out + k * g, D, w->ps, bs, rows + k * g, D, m, n, g);
        }
        if (f->outliers) value_outliers(f, c, bh, skip, p, ps, n, w->blk, gs, c->zero ? gz : 0, 0, 0, out);
        return;
    }
    float sf[MAX_HEAD_DIM], zf[MAX_HEAD_DIM];
    channel_scales(f, c, bh, h, sf, zf);
    memset(w->acc, 0, (size_t)(n * D) * sizeof(float));
    accumulate(w->acc, p + skip, ps, rows, m, n, D);
    for (int64_t i = 0; i < n; i++) {
        float psum = 0.0f;
        for (int64_t t = 0; t < m; t++) psum += p[i * ps + skip + t];
        for (int64_t d = 0; d < D; d++) out[i * D + d] += w->acc[i * D + d] * sf[d] + zf[d] * psum;
    }
    if (f->outliers) value_outliers(f, c, bh, skip, p, ps, n, w->blk, 0, 0, sf, zf, out);
}

/* The pairs bh = b * H + h in [first, last) of one decode call, with their own scratch (not inlined: inlined into the
   OpenMP region its int4 path ran 8-16 % slower on one thread). */
static __attribute__((noinline)) int64_t decode_pairs(const Fmt *kf, const Fmt *vf, const Ctx *kc, const Ctx *vc, const Decode *a, int64_t first, int64_t last) {
    const int64_t H = kf->num_heads, D = kf->head_dim, bs = kf->block_size, nb = kc->nb, n = a->n, tr = a->tail_rows;
    const int64_t C = nb * bs + tr + 1;
    const int64_t rows = bs > tr ? bs : tr;
    float *sc = malloc((size_t)(n * C + rows * D + 3 * n * D + n * bs + n + 2 * bs * D) * sizeof(float));
    if (!sc) return -2;
    Scratch w = {.blk = sc + n * C};
    w.qs = w.blk + rows * D, w.acc = w.qs + n * D, w.ps = w.acc + n * D, w.bias = w.ps + n * bs, w.qf = w.bias + n, w.gs = w.qf + n * D;
    float *blk = w.blk;  /* one block of decoded rows [bs, D] */
    for (int64_t pair = first; pair < last; pair++) {
        const int64_t b = pair / H, h = pair % H, bh = pair;
        const int64_t held = kc->held[b] < nb ? kc->held[b] : nb, ol = a->open_len[b], qp = a->q_pos[b];
        const int64_t S = held * bs, R = S + ol;  /* scores: sealed 0..S-1, open S..R-1, the new row R */
        /* keys at positions <= qp - window are outside the window: which sealed / open rows that is */
        const int64_t lo = a->window ? qp - a->window + 1 : INT64_MIN;
        /* the sealed keys' query: folded by their transforms -- or the model-space query for keys stored before RoPE,
           which are read back in model space */
        const float *q = a->q + bh * n * D, *qf = kf->pre_rope ? q : a->model_space ? w.qf : a->qf + bh * n * D;
        if (a->model_space && !kf->pre_rope) fold_query(kf, h, q, n, w.qf);
        const half *kt = a->k_tail + (a->slot[b] * H + h) * tr * D;
        const half *vt = a->v_tail + (a->slot[b] * H + h) * tr * D;
        const int64_t sink = held && a->sink_tokens && (!a->sink_ok || a->sink_ok[b]) ? a->sink_tokens : 0;
        /* scores, block by block: decoded rows, then the n dot products of each */
        for (int64_t j = 0; j < held; j++) {
            const int64_t p0 = a->first_pos[b] + j * bs;
            if (p0 + bs - 1 < lo) {  /* the whole block is outside the window: never read */
                for (int64_t i = 0; i < n; i++)
                    for (int64_t t = 0; t < bs; t++) sc[i * C + j * bs + t] = -INFINITY;
                continue;
            }
            key_scores(kf, kc, b, h, j, qf, n, &w, sc + j * bs, C);
            if (j == 0 && sink) {  /* the first rows: the model-space sink rows against the model-space query */
                half_to_float(kt + bs * D, blk, sink * D);
                dots(sc, C, q, blk, sink, n, D);
            }
            for (int64_t t = 0; t < bs && p0 + t < lo; t++)
                for (int64_t i = 0; i < n; i++) sc[i * C + j * bs + t] = -INFINITY;
        }
        half_to_float(kt, blk, ol * D);
        dots(sc + S, C, q, blk, ol, n, D);
        for (int64_t o = 0; o < ol && a->open_pos[b] + o < lo; o++)
            for (int64_t i = 0; i < n; i++) sc[i * C + S + o] = -INFINITY;
        dots(sc + R, C, q, a->new_k + bh * D, 1, n, D);
        /* softmax per query (a masked score is -inf, exp gives 0; the new row is never masked) */
        for (int64_t i = 0; i < n; i++) {
            float *restrict si = sc + i * C, mx = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t <= R; t++) si[t] *= a->scaling;
            if (a->softcap > 0.0f)
                for (int64_t t = 0; t <= R; t++)  /* a masked score stays -inf */
                    si[t] = si[t] == -INFINITY ? si[t] : a->softcap * tanhf(si[t] / a->softcap);
            for (int64_t t = 0; t <= R; t++) mx = si[t] > mx ? si[t] : mx;
            for (int64_t t = 0; t <= R; t++) {
                si[t] = expf(si[t] - mx);
                sum += si[t];
            }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t <= R; t++) si[t] *= inv;
        }
        /* outputs: sealed values (stored space), then the open rows and the new row (model space) */
        float *os = a->out_sealed + bh * n * D, *orest = a->out_rest + bh * n * D;
        memset(os, 0, (size_t)(n * D) * sizeof(float));
        memset(orest, 0, (size_t)(n * D) * sizeof(float));
        for (int64_t j = 0; j < held; j++) {
            if (a->first_pos[b] + j * bs + bs - 1 < lo) continue;
            const int64_t skip = j == 0 ? sink : 0;  /* sink rows: model space, into the rest */
            value_accumulate(vf, vc, b, h, j, skip, sc + j * bs, C, n, &w, os);
        }
        half_to_float(vt, blk, ol * D);
        accumulate(orest, sc + S, C, blk, ol, n, D);
        if (sink) {
            half_to_float(vt + bs * D, blk, sink * D);
            accumulate(orest, sc, C, blk, sink, n, D);
        }
        accumulate(orest, sc + R, C, a->new_v + bh * D, 1, n, D);
        if (a->model_space) unfold_values(vf, h, os, n, orest);
    }
    free(sc);
    return 0;
}

typedef struct {
    int64_t first, last, rc;
} Share;

int64_t trtkv_decode(const Fmt *kf, const Fmt *vf, const Ctx *kc, const Ctx *vc, const Decode *a) {
    const int64_t H = kf->num_heads, D = kf->head_dim, bs = kf->block_size, pairs = kc->batch * H;
    if (D > MAX_HEAD_DIM || vf->head_dim != D || !reads_ok(kf, kc) || !reads_ok(vf, vc) || vf->pre_rope) return -1;
    int64_t T = a->threads < 1 ? 1 : a->threads > MAX_THREADS ? MAX_THREADS : a->threads;
    if (T > pairs) T = pairs;
    if (T <= 1) return decode_pairs(kf, vf, kc, vc, a, 0, pairs);
    /* T ranges of about equal rows read (a pair reads its sealed, open and new rows) */
    int64_t total = 0;
    for (int64_t b = 0; b < kc->batch; b++) total += H * ((kc->held[b] < kc->nb ? kc->held[b] : kc->nb) * bs + a->open_len[b] + 1);
    Share share[MAX_THREADS];
    int64_t pair = 0, done = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t goal = total * (t + 1) / T;
        share[t] = (Share){pair, pair, 0};
        while (pair < pairs && (t == T - 1 || done < goal)) {
            const int64_t b = pair / H;
            done += (kc->held[b] < kc->nb ? kc->held[b] : kc->nb) * bs + a->open_len[b] + 1;
            pair++;
        }
        share[t].last = pair;
    }
    /* torch's OpenMP pool (the library shares torch's libgomp; without OpenMP the ranges run one after the other) */
    #pragma omp parallel for num_threads(T) schedule(static, 1)
    for (int64_t t = 0; t < T; t++) share[t].rc = decode_pairs(kf, vf, kc, vc, a, share[t].first, share[t].last);
    for (int64_t t = 0; t < T; t++)
        if (share[t].rc) return share[t].rc;
    return 0;
}

/* ------------------------------------------------------------------------------------------------ the seal
   trtkv_seal quantizes full blocks x [N, H, bs, D] (float32, the stored channel space: the format's transforms and a
   first block's sink replacement already applied) into the pool's storage: codes [N, H, bs, row_bytes], fp16 scales
   and zero-points -- per channel over the block (per_block_channel: [N, H, D]) or per token group ([N, H, bs, G]). The
   arithmetic is trtkv.quant._dynamic_codes', operation for operation in float32 (no contraction, no reordering), so the
   bytes equal the reference quantizer's (tests/test_cpu_attention.py). Integer dtypes; fp8, static scales and an mse
   search stay with the reference. */

typedef struct {
    int64_t head_dim, block_size, num_heads, block_wise, groups, symmetric;
    float sym_min, sym_max, asym_max;
    int64_t offset, row_bytes, n_planes, byte_off[MAX_PLANES], width[MAX_PLANES], low[MAX_PLANES], signed_bytes;
    const float *clip;  /* [H] range multipliers, or NULL (1) */
} SealFmt;

/* A slice's scale, zero-point and their inverse from its range, in their own function without contraction (the only
   place the arithmetic could contract: lo + rng * ...); the loops around it (ranges, codes: a min / max, a subtract
   and a multiply per element, nothing to contract or reorder) are outside, where the compiler vectorizes them. */
#if defined(__clang__)
#define NO_FP_REWRITE _Pragma("clang fp contract(off) reassociate(off)")
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#define NO_FP_REWRITE
#endif

static inline float to_fp16(float v) {
    v = v < -65504.0f ? -65504.0f : (v > 65504.0f ? 65504.0f : v);
    return (float)(half)v;
}

/* symmetric: hi is the slice's largest magnitude (lo unused), zero 0; asymmetric: lo .. hi its range */
static __attribute__((noinline)) void slice_params(const SealFmt *f, float lo, float hi, float clip, float *s, float *z, float *inv) {
    NO_FP_REWRITE
    if (f->symmetric) {
        *s = to_fp16(hi * clip / f->sym_max);
        *z = 0.0f;
    } else {
        const float rng = hi - lo;
        *z = to_fp16(lo + rng * (1.0f - clip) / 2.0f);
        *s = to_fp16(rng * clip / f->asym_max);
    }
    *inv = *s > 0.0f ? 1.0f / *s : 0.0f;
}

#if !defined(__clang__)
#pragma GCC pop_options
#endif

/* codes of one value (finite: the caller checked, so the clamps are min / max), stored as the pool stores them */
static inline int code_of(const SealFmt *f, float x, float z, float inv) {
    const float lo = f->symmetric ? f->sym_min : 0.0f, hi = f->symmetric ? f->sym_max : f->asym_max;
    float c = rintf(f->symmetric ? x * inv : (x - z) * inv);
    c = c < lo ? lo : (c > hi ? hi : c);
    return (int)c + (f->symmetric ? (int)f->offset : 0);
}

/* scale (and zero) of the values x[i], i < m, and their codes into q[i] */
static void quant_slice(const SealFmt *f, const float *restrict x, int64_t m, float clip, int *restrict q, float *scale, float *zero) {
    float lo = x[0], hi = f->symmetric ? 0.0f : x[0], s, z, inv;
    for (int64_t i = 0; i < m; i++) {
        const float v = f->symmetric ? fabsf(x[i]) : x[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    slice_params(f, lo, hi, clip, &s, &z, &inv);
    for (int64_t i = 0; i < m; i++) q[i] = code_of(f, x[i], z, inv);
    *scale = s;
    *zero = z;
}

/* quant_slice of each channel of a block xb [bs, D] over its rows, channels side by side (rows read in order: the
   loops over d vectorize) */
static void quant_block_channels(const SealFmt *f, const float *restrict xb, float clip, int *restrict q, half *scale, half *zero) {
    const int64_t D = f->head_dim, bs = f->block_size;
    float z[MAX_HEAD_DIM], inv[MAX_HEAD_DIM], lo[MAX_HEAD_DIM], hi[MAX_HEAD_DIM];
    const int sym = (int)f->symmetric;
    for (int64_t d = 0; d < D; d++) lo[d] = hi[d] = sym ? 0.0f : xb[d];
    for (int64_t t = 0; t < bs; t++)
        for (int64_t d = 0; d < D; d++) {
            const float v = sym ? fabsf(xb[t * D + d]) : xb[t * D + d];
            lo[d] = v < lo[d] ? v : lo[d];
            hi[d] = v > hi[d] ? v : hi[d];
        }
    for (int64_t d = 0; d < D; d++) {
        float s;
        slice_params(f, lo[d], hi[d], clip, &s, &z[d], &inv[d]);
        scale[d] = (half)s;
        if (zero) zero[d] = (half)z[d];
    }
    for (int64_t t = 0; t < bs; t++)
        for (int64_t d = 0; d < D; d++) q[t * D + d] = code_of(f, xb[t * D + d], z[d], inv[d]);
}

/* one bit plane of a row: byte j holds bits low .. low + w - 1 of the codes j * 8 / w + i, i < 8 / w, at bit i * w
   (trtkv.formats.DtypeTraits._pack) */
static inline __attribute__((always_inline)) void pack_plane(const int *restrict qr, uint8_t *restrict row, int64_t n, const int w,
                                                             const int64_t low) {
    const int per = 8 / w, mask = (1 << w) - 1;
    for (int64_t j = 0; j < n; j++) {
        int byte = 0;
        for (int i = 0; i < per; i++) byte |= ((qr[j * per + i] >> low) & mask) << (i * w);
        row[j] = (uint8_t)byte;
    }
}

/* slabs [first, last) of the n * H (block, head) slabs, with q: bs * D ints of scratch; -3 at a NaN or inf */
static int64_t seal_slabs(const SealFmt *f, const float *x, int64_t first, int64_t last, uint8_t *codes, half *scale, half *zero, int *q) {
    const int64_t H = f->num_heads, D = f->head_dim, bs = f->block_size, G = f->groups;
    for (int64_t bh = first; bh < last; bh++) {
        const int64_t h = bh % H;
        const float *xb = x + bh * bs * D;
        int finite = 1;
        for (int64_t i = 0; i < bs * D; i++) finite &= isfinite(xb[i]) != 0;
        if (!finite) return -3;
        const float clip = f->clip ? f->clip[h] : 1.0f;
        if (f->block_wise) {
            quant_block_channels(f, xb, clip, q, scale + bh * D, zero ? zero + bh * D : 0);
        } else {
            const int64_t g = D / G;
            for (int64_t t = 0; t < bs; t++)
                for (int64_t k = 0; k < G; k++) {
                    float s, z;
                    quant_slice(f, xb + t * D + k * g, g, clip, q + t * D + k * g, &s, &z);
                    scale[(bh * bs + t) * G + k] = (half)s;
                    if (zero) zero[(bh * bs + t) * G + k] = (half)z;
                }
        }
        /* pack each row plane after plane (trtkv.formats.DtypeTraits._pack) */
        uint8_t *out = codes + bh * bs * f->row_bytes;
        for (int64_t t = 0; t < bs; t++) {
            const int *qr = q + t * D;
            uint8_t *row = out + t * f->row_bytes;
            if (f->signed_bytes) {
                for (int64_t d = 0; d < D; d++) row[d] = (uint8_t)(int8_t)qr[d];
                continue;
            }
            for (int64_t p = 0; p < f->n_planes; p++) {
                const int64_t w = f->width[p], low = f->low[p], n = D / (8 / w);
                uint8_t *dst = row + f->byte_off[p];
                if (w == 4) pack_plane(qr, dst, n, 4, low);  /* constant widths: the per-byte loop unrolls and vectorizes */
                else if (w == 2) pack_plane(qr, dst, n, 2, low);
                else if (w == 1) pack_plane(qr, dst, n, 1, low);
                else pack_plane(qr, dst, n, 8, low);
            }
        }
    }
    return 0;
}

/* n blocks, their (block, head) slabs split over ``threads`` OpenMP threads (torch's pool, as the decode's); -3 where
   x holds a NaN or inf (nothing to quantize: the caller's one-line error) */
int64_t trtkv_seal(const SealFmt *f, const float *x, int64_t n, uint8_t *codes, half *scale, half *zero, int64_t threads) {
    const int64_t H = f->num_heads, D = f->head_dim, bs = f->block_size, G = f->groups, slabs = n * H;
    if (D > MAX_HEAD_DIM || (!f->block_wise && (G < 1 || D % G))) return -1;
    if (slabs < 1) return 0;
    int64_t T = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (T > slabs) T = slabs;
    int *q = malloc((size_t)(T * bs * D) * sizeof(int));
    if (!q) return -2;
    int64_t rc[MAX_THREADS];
    #pragma omp parallel for num_threads(T) schedule(static, 1)
    for (int64_t t = 0; t < T; t++) rc[t] = seal_slabs(f, x, slabs * t / T, slabs * (t + 1) / T, codes, scale, zero, q + t * bs * D);
    free(q);
    for (int64_t t = 0; t < T; t++)
        if (rc[t]) return rc[t];
    return 0;
}
