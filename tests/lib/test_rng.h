/*
 * Test data from a seed: splitmix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number
 * generators", OOPSLA'14). Each test program keeps its own state, so its data does not depend
 * on any other program. Header-only; not for the server (src/core has the Philox RNG).
 */
#ifndef TANDEM_TEST_RNG_H
#define TANDEM_TEST_RNG_H

#include <stdint.h>

static inline uint64_t tdm_test_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#endif /* TANDEM_TEST_RNG_H */
