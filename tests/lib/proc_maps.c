/* tests/lib/proc_maps.h */
#include "lib/proc_maps.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool tdm_test_mapped(const char *name)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) {
        fprintf(stderr, "cannot read /proc/self/maps\n");
        exit(2);
    }
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, name) != NULL;
    fclose(f);
    return found;
}
