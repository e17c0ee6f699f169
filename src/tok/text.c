/*
 * UTF-8 validation and coding, the GPT-2 byte-level alphabet, and Python's notion of
 * whitespace (which Jinja's `trim` uses).
 *
 * Validation is strict RFC 3629 so that everything past tdm_tok_encode's entry check can use
 * PCRE2_NO_UTF_CHECK and decode without bounds surprises: after a successful check every lead
 * byte announces a sequence that is entirely present and well formed.
 *
 * All functions are pure and thread-safe.
 */
#include "tok/tok_int.h"

bool tdm_tok_utf8_valid(const char *s, size_t len, size_t *bad_off)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned char c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) {
            n = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0)
                lo = 0xA0; /* overlong */
            else if (c == 0xED)
                hi = 0x9F; /* surrogates */
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0)
                lo = 0x90; /* overlong */
            else if (c == 0xF4)
                hi = 0x8F; /* above U+10FFFF */
        } else {
            if (bad_off) *bad_off = i;
            return false;
        }
        if (len - i < n) {
            if (bad_off) *bad_off = i;
            return false;
        }
        if (p[i + 1] < lo || p[i + 1] > hi) {
            if (bad_off) *bad_off = i;
            return false;
        }
        for (size_t k = 2; k < n; k++) {
            if ((p[i + k] & 0xC0) != 0x80) {
                if (bad_off) *bad_off = i;
                return false;
            }
        }
        i += n;
    }
    return true;
}

int tdm_tok_utf8_len(unsigned char lead)
{
    if (lead < 0x80) return 1;
    if (lead < 0xE0) return 2;
    if (lead < 0xF0) return 3;
    return 4;
}

int tdm_tok_utf8_decode(const char *s, uint32_t *cp)
{
    const unsigned char *p = (const unsigned char *)s;
    int n = tdm_tok_utf8_len(p[0]);
    uint32_t c;
    switch (n) {
    case 1:
        c = p[0];
        break;
    case 2:
        c = (uint32_t)(p[0] & 0x1F) << 6 | (p[1] & 0x3F);
        break;
    case 3:
        c = (uint32_t)(p[0] & 0x0F) << 12 | (uint32_t)(p[1] & 0x3F) << 6 | (p[2] & 0x3F);
        break;
    default:
        c = (uint32_t)(p[0] & 0x07) << 18 | (uint32_t)(p[1] & 0x3F) << 12 |
            (uint32_t)(p[2] & 0x3F) << 6 | (p[3] & 0x3F);
        break;
    }
    *cp = c;
    return n;
}

int tdm_tok_utf8_encode(uint32_t cp, char *buf)
{
    unsigned char *b = (unsigned char *)buf;
    if (cp < 0x80) {
        b[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        b[0] = (unsigned char)(0xC0 | cp >> 6);
        b[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        b[0] = (unsigned char)(0xE0 | cp >> 12);
        b[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        b[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    b[0] = (unsigned char)(0xF0 | cp >> 18);
    b[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    b[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    b[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* GPT-2's alphabet: the printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF)
 * stand for themselves; the other 68 bytes take U+0100, U+0101, ... in byte order, so every
 * byte has a visible, non-space character. */
void tdm_tok_bytes_to_unicode(uint16_t map[256])
{
    uint16_t next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        map[b] = printable ? (uint16_t)b : next++;
    }
}

bool tdm_tok_is_py_space(uint32_t cp)
{
    if (cp >= 0x09 && cp <= 0x0D) return true;
    if (cp >= 0x1C && cp <= 0x20) return true;
    switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
        return true;
    default:
        return cp >= 0x2000 && cp <= 0x200A;
    }
}
