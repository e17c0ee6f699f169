/*
 * What the test process itself has loaded (for the tests of libraries opened on first use).
 * Stateless; any thread.
 */
#ifndef TANDEM_TESTS_LIB_PROC_MAPS_H
#define TANDEM_TESTS_LIB_PROC_MAPS_H

#include <stdbool.h>

/* Whether a file whose path contains `name` is mapped into this process (/proc/self/maps).
 * Exits with a message where the maps cannot be read. */
bool tdm_test_mapped(const char *name);

#endif
