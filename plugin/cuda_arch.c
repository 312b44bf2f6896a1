/* cuda_arch.c -- SM targets against a device's compute capability. */
#include "cuda_arch.h"

#include <stdlib.h>

int mm_cuda_archs_run_on(const char *archs, int major, int minor) {
  for (const char *s = archs; s && *s;) {
    char *end;
    const long sm = strtol(s, &end, 10);
    if (end == s || sm < 10 || sm > 999) return 0;
    const int specific = *end == 'a'; /* 90a: that capability only */
    if (specific || *end == 'f') end++; /* 100f: the family, the same major */
    if (*end && *end != ',') return 0;
    const int tmajor = (int)(sm / 10), tminor = (int)(sm % 10);
    if (specific ? major == tmajor && minor == tminor : major == tmajor && minor >= tminor)
      return 1;
    s = *end ? end + 1 : end;
  }
  return 0;
}
