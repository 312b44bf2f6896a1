/* spelling.h -- how far apart two names are, for "did you mean" suggestions
 * (config keys and values, environment knobs). */
#ifndef MM_SPELLING_H
#define MM_SPELLING_H

#define MM_SPELLING_MAX 128 /* longer inputs are never close to anything */

/* Optimal string alignment distance: insertions, deletions, substitutions
 * and adjacent transpositions cost 1 each. INT_MAX when either input is
 * longer than MM_SPELLING_MAX bytes. */
int mm_osa_distance(const char *a, const char *b);

#endif
