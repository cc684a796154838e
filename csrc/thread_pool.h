// A small persistent thread pool for the kernels. Plain C++ (no OpenMP, no
// torch), so the kernels build and run in the C++ tests and can be driven from
// any thread, including the offload engine's workers.
#pragma once

#include <cstdint>
#include <functional>

namespace offload_adam {

// Runs fn(i) for every i in [0, n) on up to num_threads threads; the calling
// thread is one of them. Each thread starts on a contiguous slice of [0, n) of its
// own and, when done, takes the next indices of the others' slices (an atomic
// cursor per slice), so a thread slowed by other work on its core takes fewer.
// Calls from several threads are serialised. fn must not throw and must not call
// parallel_for.
// A thread the system refuses to start (a limit on processes or memory: ulimit -u or
// -v, a cgroup's pids.max) is not an error: the job runs on the threads there are
// (the results do not depend on how many), and the refusal is counted.
void parallel_for(int64_t n, int num_threads, const std::function<void(int64_t)>& fn);

// How many thread starts the system has refused so far (see parallel_for).
int threads_refused();

}  // namespace offload_adam
