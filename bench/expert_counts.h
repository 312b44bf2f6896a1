/* expert_counts.h -- the expert loads of bench_moe_compute: how many of a
 * pool's M rows each of E local experts holds. One definition for the
 * benchmark and for the test that checks scripts/padding_by_count.py's copy
 * of it (tests/test_padding_by_count.sh). */
#ifndef MM_EXPERT_COUNTS_H
#define MM_EXPERT_COUNTS_H

enum { MM_LOAD_UNIFORM, MM_LOAD_SKEWED, MM_LOAD_RANDOM, MM_LOAD_ZIPF, MM_LOAD_COUNT };

/* "uniform", "skewed", "random", "zipf", by the enum above */
extern const char *const mm_load_names[MM_LOAD_COUNT];

/* The load named name, or -1. */
int mm_load_by_name(const char *name);

/* cnt[0..E) = the rows of each expert, summing to M (M >= 0, E >= 1):
 * uniform: M / E each (the first M % E one more); skewed: expert 0 takes
 * half, the others share the rest as uniform does; random: each row's
 * expert drawn uniformly (xorshift32 seeded with M, so every build and run
 * sees the same counts); zipf: drawn with weight 1 / (e + 1), from the same
 * sequence. */
void mm_load_counts(int load, int M, int E, int *cnt);

#endif
