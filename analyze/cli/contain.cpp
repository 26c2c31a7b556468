// Containment. Dumps are untrusted input, and HDF5 1.10 itself can crash (segmentation faults in
// its global heap and variable-length conversions) or loop forever on a damaged or crafted file,
// below anything dynaprobe can check first. So each command runs in a child process, under a
// memory limit (RLIMIT_AS) and a wall-clock limit, while this process only waits: a child that
// dies by a signal or runs past the limit becomes exit code 3 with the name of the file it was
// reading. A child process was chosen over checking files up front (the crashes are inside HDF5's
// own parsing, which cannot be pre-validated) and over threads (a crash takes the whole process).
// It costs one fork (about a millisecond) per command; the report is written by the child.
// docs/cli.md#damaged-and-untrusted-dumps.
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <new>
#include <thread>

#include "cli.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::cli {
namespace fs = std::filesystem;

namespace {

// The file the child is reading, in memory shared with this process.
struct SharedFile {
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  char path[4096];
};
SharedFile* shared_file = nullptr;

void note_open(const fs::path& path) {
  if (!shared_file) return;
  while (shared_file->busy.test_and_set(std::memory_order_acquire)) {
  }
  std::snprintf(shared_file->path, sizeof(shared_file->path), "%s", path.c_str());
  shared_file->busy.clear(std::memory_order_release);
}

// The file being read when something went wrong, else the command's dumps.
std::string reading(const Command& command) {
  return shared_file && shared_file->path[0] ? std::string(shared_file->path) : command.reads;
}

std::uint64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), size = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0
             ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(size)
             : 0;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;  // its shadow memory needs a huge address space
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

// Runs the command in this process; errors become their message on stderr and their exit code.
int run_here(const Command& command) {
  try {
    return command.run();
  } catch (...) {
    const Failure failure = failure_of(std::current_exception(), reading(command));
    std::cout.flush();
    std::cerr << "dynaprobe: error: " << failure.message << "\n";
    return failure.code;
  }
}

}  // namespace

void add_limit_options(CLI::App& app, Limits& limits) {
  app.add_option("--time-limit", limits.seconds,
                 "Stop reading after this many seconds and exit 3 (default 3600; 0: none)")
      ->type_name("S")
      ->check(non_negative("600"));
  app.add_option("--memory-limit", limits.memory_mib,
                 "Address-space limit of the reading process in MiB, exit 3 past it (default: "
                 "the machine's memory)")
      ->type_name("MIB")
      ->check(non_negative("4096", /*integer=*/true));
}

int run_contained(const Limits& limits, const Command& command) {
  if (!limits.isolate) return run_here(command);
  void* memory = ::mmap(nullptr, sizeof(SharedFile), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return run_here(command);
  shared_file = new (memory) SharedFile();
  std::cout.flush();
  std::fflush(nullptr);
  // Forked before any thread exists (TBB and HDF5 start theirs in the child).
  const pid_t child = ::fork();
  if (child < 0) return run_here(command);
  if (child == 0) {
    const std::uint64_t bytes = limits.memory_mib ? limits.memory_mib << 20 : physical_memory();
    if (bytes && !kAddressSanitizer) {
      const rlimit limit{static_cast<rlim_t>(bytes), static_cast<rlim_t>(bytes)};
      ::setrlimit(RLIMIT_AS, &limit);
    }
    formats::set_open_observer(note_open);
    const int code = run_here(command);
    std::cout.flush();
    std::fflush(nullptr);
    ::_exit(code);  // no atexit handlers: HDF5's could trip over the damage again
  }
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  bool timed_out = false;
  auto pause = std::chrono::microseconds(500);
  for (;;) {
    const pid_t done = ::waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 && errno != EINTR) {
      std::cerr << "dynaprobe: error: lost the process reading " << command.reads << ": "
                << std::strerror(errno) << "; run the command again\n";
      return kExitIo;
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (limits.seconds > 0 && elapsed > limits.seconds) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  if (!timed_out && WIFEXITED(status)) return WEXITSTATUS(status);
  // The reader of our output went away (`dynaprobe ls | head`): not damage, nothing to say; exit
  // as a shell reports a process that SIGPIPE ended.
  if (!timed_out && WIFSIGNALED(status) && WTERMSIG(status) == SIGPIPE) return 128 + SIGPIPE;
  const std::string file = reading(command);
  std::cout.flush();
  if (timed_out) {
    std::cerr << "dynaprobe: error: " << file << ": reading did not finish within "
              << limits.seconds
              << " s and was stopped (HDF5 loops forever on some damaged files); the file is "
                 "damaged, or raise --time-limit for a very large dump\n";
  } else {
    const int signal = WTERMSIG(status);
    std::cerr << "dynaprobe: error: " << file << ": reading it crashed the reader (signal "
              << signal << ", " << ::strsignal(signal)
              << "); the file is damaged or not a dynaprobe dump"
              << (signal == SIGKILL || signal == SIGABRT
                      ? " (or it needed more memory than --memory-limit allows)"
                      : "")
              << "\n";
  }
  return kExitIo;
}

}  // namespace dynaprobe::cli
