// Scheduling niceness for TBB arenas: a capture's background work (judging, compression, writes)
// runs below the training threads, so that it takes the cores in the gaps training leaves.
#pragma once

#include <sys/resource.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

namespace dynaprobe::formats {

// Gives the threads that work in `arena` niceness `nice` while they are in it. Linux lets an
// unprivileged thread raise its niceness but not lower it again (RLIMIT_NICE), so a TBB worker
// may keep the higher niceness after it leaves; only dynaprobe's work runs on TBB workers in a
// training process (torch uses OpenMP threads).
class NiceObserver : public tbb::task_scheduler_observer {
 public:
  NiceObserver(tbb::task_arena& arena, int nice)
      : tbb::task_scheduler_observer(arena), nice_(nice) {
    observe(true);
  }
  ~NiceObserver() override { observe(false); }

  void on_scheduler_entry(bool) override {
    previous() = getpriority(PRIO_PROCESS, 0);  // with 0, Linux means the calling thread
    setpriority(PRIO_PROCESS, 0, nice_);
  }
  void on_scheduler_exit(bool) override { setpriority(PRIO_PROCESS, 0, previous()); }

 private:
  static int& previous() {
    static thread_local int value = 0;
    return value;
  }
  int nice_;
};

}  // namespace dynaprobe::formats
