// The C++ tests' assertion: a failed CHECK says where and what, counts, and the test goes
// on; main returns checks_result().
#pragma once

#include <cstdio>

static int g_failures = 0;
#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ++g_failures;                                                        \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                   \
      std::fprintf(stderr, "\n");                                          \
    }                                                                      \
  } while (0)

// Prints the outcome; the process's exit status.
inline int checks_result() {
  if (g_failures) std::printf("%d check(s) failed\n", g_failures);
  else std::printf("all checks passed\n");
  return g_failures ? 1 : 0;
}
