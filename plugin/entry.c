/* entry.c -- placeholder, replaced below */
