// Crash safety of the writer (DESIGN.md "Errors", writer.h): a run killed mid-step or stopped by a
// full disk loses at most the step in progress, and every committed step still reads back bit for
// bit. The writer runs as a real process (step_writer_fixture) so that SIGKILL and file-size
// limits hit it the way they hit a training job.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/writer.h"
#include "test_util.h"

namespace dynaprobe::formats {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kBytesPerStep = 256 << 10;  // several 64 KiB chunks per record
constexpr auto kFixtureTimeout = std::chrono::seconds(120);

// One run of step_writer_fixture with its stdout and stderr on pipes.
class FixtureProcess {
 public:
  // fork + execv, never fork alone: the child of a multi-threaded process (TBB workers) may only
  // call async-signal-safe functions before exec, so everything is prepared before fork().
  // `file_size_limit` sets RLIMIT_FSIZE in the child, with SIGXFSZ ignored so that a write past
  // the limit fails with EFBIG (as on a full disk) instead of killing the writer.
  FixtureProcess(std::vector<std::string> args, std::optional<rlim_t> file_size_limit = {}) {
    args.insert(args.begin(), DYNAPROBE_STEP_WRITER_FIXTURE);
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << std::strerror(errno);
      return;
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      if (file_size_limit) {
        const rlimit limit{*file_size_limit, *file_size_limit};
        ::signal(SIGXFSZ, SIG_IGN);  // an ignored signal stays ignored across execv
        if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(126);
      }
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
    if (pid_ < 0) ADD_FAILURE() << "fork: " << std::strerror(errno);
  }
  ~FixtureProcess() {
    if (pid_ > 0) {  // a failed assertion left it running
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    if (err_fd_ >= 0) ::close(err_fd_);
  }
  FixtureProcess(const FixtureProcess&) = delete;
  FixtureProcess& operator=(const FixtureProcess&) = delete;

  // Reads stdout and stderr until stdout holds `line` (returns true) or both pipes close or the
  // timeout passes (returns false). An empty `line` reads to the end.
  bool read_until(const std::string& line) {
    const auto deadline = std::chrono::steady_clock::now() + kFixtureTimeout;
    while (line.empty() || out_.find(line + "\n") == std::string::npos) {
      if (out_fd_ < 0 && err_fd_ < 0) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
      if (::poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) return false;
      drain(fds[0], out_fd_, out_);
      drain(fds[1], err_fd_, err_);
    }
    return true;
  }

  // Kills with SIGKILL (nothing runs in the writer afterwards: no destructor, no flush).
  void kill() { ::kill(pid_, SIGKILL); }

  // Waits for the process to end and returns its wait status.
  int wait() {
    read_until("");
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return status;
  }

  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

 private:
  static void drain(const pollfd& polled, int& fd, std::string& text) {
    if (fd < 0 || !(polled.revents & (POLLIN | POLLHUP | POLLERR))) return;
    char buffer[4096];
    const ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got > 0) {
      text.append(buffer, static_cast<std::size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      ::close(fd);
      fd = -1;
    }
  }

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  std::string out_;
  std::string err_;
};

// Every record of a committed step reads back exactly as the fixture wrote it.
void expect_step_intact(const fs::path& file, std::int64_t step, std::size_t bytes) {
  SCOPED_TRACE("step file " + file.string());
  const StepReader reader(file);
  EXPECT_EQ(reader.step(), step);
  const testing::FixtureStep expected = testing::fixture_step(step, bytes);
  ASSERT_EQ(reader.records().size(), expected.records.size());
  for (std::size_t i = 0; i < expected.records.size(); ++i) {
    const RecordInfo* info = reader.find(expected.records[i].key);
    ASSERT_NE(info, nullptr) << to_string(expected.records[i].key);
    EXPECT_EQ(reader.read(*info), expected.data[i]) << to_string(info->key);
  }
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

TEST(CrashSafety, KillMidStepKeepsCommittedStepsAndLeavesOnePartial) {
  const testing::TempDir tmp;
  const fs::path dump = tmp.path() / "rank0";
  constexpr int kKilledStep = 3;
  FixtureProcess writer({dump.string(), "10", std::to_string(kBytesPerStep), "--pause-in-step",
                         std::to_string(kKilledStep)});
  ASSERT_TRUE(writer.read_until("writing " + std::to_string(kKilledStep)))
      << "stdout: " << writer.out() << "\nstderr: " << writer.err();
  writer.kill();
  const int status = writer.wait();
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << describe(status);

  const DumpFiles files = list_dump(dump);
  ASSERT_EQ(files.steps.size(), static_cast<std::size_t>(kKilledStep));
  for (int step = 0; step < kKilledStep; ++step) {
    EXPECT_EQ(files.steps[step], dump / step_file_name(step));
    expect_step_intact(files.steps[step], step, kBytesPerStep);
  }
  fs::path partial = dump / step_file_name(kKilledStep);
  partial += ".partial";
  EXPECT_EQ(files.unfinished, std::vector<fs::path>{partial});

  // The step in progress is lost, but a reader that is handed its file anyway says so instead of
  // crashing or returning half a step.
  try {
    StepReader reader(partial);
    ADD_FAILURE() << "opened the partial file of a killed writer";
  } catch (const FormatError& error) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, partial.string(), error.what());
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "an unfinished step", error.what());
  }
}

TEST(CrashSafety, FileTooLargeFailsTheStepCleanlyAndKeepsEarlierSteps) {
  const testing::TempDir tmp;
  // Step s holds (s + 1) * kBytesPerStep bytes (--grow). A reference run without a limit gives
  // the sizes of the step files, and the limit is set between those of steps 1 and 2.
  const fs::path reference = tmp.path() / "reference";
  {
    FixtureProcess writer({reference.string(), "3", std::to_string(kBytesPerStep), "--grow"});
    const int status = writer.wait();
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << describe(status) << "\nstderr: " << writer.err();
  }
  const auto size1 = fs::file_size(reference / step_file_name(1));
  const auto size2 = fs::file_size(reference / step_file_name(2));
  ASSERT_LT(size1 + (16 << 10), size2);
  const rlim_t limit = (size1 + size2) / 2;

  const fs::path dump = tmp.path() / "rank0";
  FixtureProcess writer({dump.string(), "4", std::to_string(kBytesPerStep), "--grow"}, limit);
  const int status = writer.wait();
  ASSERT_TRUE(WIFEXITED(status)) << describe(status) << "\nstderr: " << writer.err();
  EXPECT_EQ(WEXITSTATUS(status), 3) << "stderr: " << writer.err();
  EXPECT_EQ(writer.out(), "committed 0\ncommitted 1\n");
  // The message names the file that could not be written and why (EFBIG's strerror).
  const std::string partial = (dump / step_file_name(2)).string() + ".partial";
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, partial, writer.err());
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "File too large", writer.err());

  const DumpFiles files = list_dump(dump);
  ASSERT_EQ(files.steps.size(), 2u);
  expect_step_intact(files.steps[0], 0, kBytesPerStep);
  expect_step_intact(files.steps[1], 1, 2 * kBytesPerStep);
  EXPECT_FALSE(fs::exists(dump / step_file_name(2)));
  // The failed writer removed its partial file on the way out.
  EXPECT_TRUE(files.unfinished.empty());
}

// Lowers this process's file-size limit (SIGXFSZ ignored: a write past it fails with EFBIG, as
// on a full disk) for the object's lifetime.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    previous_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{bytes, saved_.rlim_max};
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0) << std::strerror(errno);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, previous_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit saved_{};
  sighandler_t previous_handler_ = SIG_DFL;
};

// A tmpfs of `bytes` mounted at a new folder of `parent` for the object's lifetime; mounted()
// says why not where the test may not mount (it needs root, as CI and this project's machines
// have).
class SmallDisk {
 public:
  SmallDisk(const fs::path& parent, std::size_t bytes) : path_(parent / "small_disk") {
    fs::create_directory(path_);
    const std::string options = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", path_.c_str(), "tmpfs", 0, options.c_str()) != 0) {
      why_not_ = std::string("cannot mount a tmpfs here: ") + std::strerror(errno);
    }
  }
  ~SmallDisk() {
    if (why_not_.empty()) ::umount2(path_.c_str(), MNT_DETACH);
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;
  const fs::path& path() const { return path_; }
  const std::string& why_not() const { return why_not_; }

 private:
  fs::path path_;
  std::string why_not_;
};

// Step 1 of `dir`, 16 MiB in chunks of 1 MiB, cannot be stored (`reason`, strerror's text; a full
// disk, or the file-size limit `limit` makes of step 0's file size): whichever way its chunks go to
// the disk (from the record's own page-aligned memory, copied from unaligned memory, compressed),
// write() fails with IoError naming the file and the reason, the step cannot be committed, its
// partial file goes, and step 0 reads back intact.
void expect_a_lost_step_keeps_the_earlier(
    const fs::path& dir, const std::string& reason,
    const std::function<std::unique_ptr<FileSizeLimit>(std::uintmax_t)>& limit) {
  constexpr std::size_t kBytes = 16 << 20;
  constexpr std::size_t kPage = 4096;
  const std::vector<std::byte> random = testing::random_bytes(kBytes, 7);
  std::vector<std::byte> bf16_rounded = testing::random_bytes(kBytes, 8);
  for (std::size_t i = 0; i < kBytes; i += 4) {  // low 16 bits zero: chunks compress about 2x
    bf16_rounded[i] = bf16_rounded[i + 1] = std::byte{0};
  }
  std::unique_ptr<std::byte, decltype(&std::free)> memory(
      static_cast<std::byte*>(std::aligned_alloc(kPage, kBytes + kPage)), &std::free);
  ASSERT_NE(memory, nullptr);
  const testing::FixtureStep step0 = testing::fixture_step(0, 4096);
  {
    StepWriter writer(dir, 0, {});
    writer.write(step0.records);
    writer.commit();
  }
  const auto committed_size = fs::file_size(dir / step_file_name(0));
  struct Case {
    const char* name;
    const std::vector<std::byte>& data;
    std::size_t misalignment;
  };
  for (const Case& c :
       {Case{"aligned, stored as is", random, 0}, Case{"unaligned, stored as is", random, 16},
        Case{"compressed", bf16_rounded, 0}}) {
    SCOPED_TRACE(c.name);
    std::byte* data = memory.get() + c.misalignment;
    std::memcpy(data, c.data.data(), kBytes);
    Record record;
    record.key = RecordKey{1, "layers.0", 0, Kind::kFwdOutput, 0, Side::kEager};
    record.tensor =
        TensorView{DType::kFloat32, {1024, static_cast<std::int64_t>(kBytes / 4096)}, data};
    fs::path partial = dir / step_file_name(1);
    partial += ".partial";
    {
      const auto in_force = limit(committed_size);
      StepWriter writer(dir, 1, {});
      try {
        writer.write(record);
        ADD_FAILURE() << "wrote 16 MiB where there was no room";
      } catch (const IoError& error) {
        EXPECT_PRED_FORMAT2(::testing::IsSubstring, partial.string(), error.what());
        EXPECT_PRED_FORMAT2(::testing::IsSubstring, reason, error.what());
      }
      EXPECT_THROW(writer.commit(), IoError);
    }
    EXPECT_FALSE(fs::exists(partial));
    EXPECT_FALSE(fs::exists(dir / step_file_name(1)));
  }
  expect_step_intact(dir / step_file_name(0), 0, 4096);
}

// Chunks go to the disk asynchronously while later chunks compress (direct_driver.h). A write
// past a file-size limit fails as the file is given room for it.
TEST(CrashSafety, WritePastAFileSizeLimitIsIoErrorFromWriteAndKeepsEarlierSteps) {
  const testing::TempDir tmp;
  expect_a_lost_step_keeps_the_earlier(
      tmp.path(), std::strerror(EFBIG), [](std::uintmax_t committed_size) {
        return std::make_unique<FileSizeLimit>(committed_size + (3 << 20));
      });
}

// On a full disk the write in flight fails: its failure reaches the write() call that handed
// it over.
TEST(CrashSafety, FullDiskIsIoErrorFromWriteAndKeepsEarlierSteps) {
  const testing::TempDir tmp;
  const SmallDisk disk(tmp.path(), 6 << 20);
  if (!disk.why_not().empty()) GTEST_SKIP() << disk.why_not();
  expect_a_lost_step_keeps_the_earlier(disk.path(), std::strerror(ENOSPC), [](std::uintmax_t) {
    return std::unique_ptr<FileSizeLimit>();  // the disk itself is the limit
  });
}

TEST(CrashSafety, DumpFolderUnderARegularFileIsIoErrorNamingThePath) {
  // A path below a regular file can never be created, even by root (a read-only folder would not
  // stop root, and the tests may run as root).
  const testing::TempDir tmp;
  const fs::path file = tmp.path() / "file";
  testing::write_file(file, "not a folder");
  const fs::path dump = file / "dump";
  try {
    StepWriter writer(dump, 0, {});
    FAIL() << "created a step writer under a regular file";
  } catch (const IoError& error) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, dump.string(), error.what());
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "Not a directory", error.what());
  }
  EXPECT_FALSE(fs::exists(dump));
}

TEST(CrashSafety, UncreatableStepFileIsIoErrorNamingTheFile) {
  // The folder exists but the partial file cannot be created (a folder is in its way).
  const testing::TempDir tmp;
  fs::path partial = tmp.path() / step_file_name(0);
  partial += ".partial";
  fs::create_directory(partial);
  try {
    StepWriter writer(tmp.path(), 0, {});
    FAIL() << "created a step writer over a folder";
  } catch (const IoError& error) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, partial.string(), error.what());
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "is not a regular file", error.what());
  }
}

TEST(CrashSafety, CommittedStepIsNeverOverwritten) {
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 4096);
  {
    StepWriter writer(tmp.path(), 0, {});
    writer.write(content.records);
    writer.commit();
  }
  const fs::path committed = tmp.path() / step_file_name(0);
  try {
    StepWriter writer(tmp.path(), 0, {});
    FAIL() << "opened a writer over committed step 0";
  } catch (const IoError& error) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, committed.string(), error.what());
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "never overwrites", error.what());
  }
  // The refused writer left neither a partial file nor a changed step behind.
  EXPECT_TRUE(list_dump(tmp.path()).unfinished.empty());
  expect_step_intact(committed, 0, 4096);
}

std::string file_content(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A symbolic link planted at a step's .partial name (pointing at an existing file or at nothing)
// is refused: the writer never writes through it, so nothing outside the dump folder changes or
// appears.
TEST(CrashSafety, LinkAtThePartialNameIsRefusedAndNothingOutsideIsWritten) {
  const testing::TempDir tmp;
  const fs::path dump = tmp.path() / "dump";
  fs::create_directory(dump);
  const fs::path outside = tmp.path() / "outside.txt";
  testing::write_file(outside, "precious");
  fs::path partial = dump / step_file_name(0);
  partial += ".partial";
  for (const fs::path& target : {outside, tmp.path() / "created-outside.h5"}) {
    fs::remove(partial);
    fs::create_symlink(target, partial);
    try {
      StepWriter writer(dump, 0, {});
      FAIL() << "wrote through a link to " << target;
    } catch (const IoError& error) {
      EXPECT_PRED_FORMAT2(::testing::IsSubstring, "is a symbolic link", error.what());
    }
    EXPECT_TRUE(fs::is_symlink(partial));  // left for the user to look at
  }
  EXPECT_EQ(file_content(outside), "precious");
  EXPECT_FALSE(fs::exists(tmp.path() / "created-outside.h5"));
  EXPECT_FALSE(fs::exists(fs::symlink_status(dump / step_file_name(0))));
}

// A link at the committed name, even a dangling one, is never replaced nor followed.
TEST(CrashSafety, LinkAtTheCommittedNameIsNeverReplaced) {
  const testing::TempDir tmp;
  const fs::path target = tmp.path() / "elsewhere.h5";
  fs::create_symlink(target, tmp.path() / step_file_name(0));
  EXPECT_THROW(StepWriter(tmp.path(), 0, {}), IoError);
  EXPECT_FALSE(fs::exists(target));
  EXPECT_TRUE(fs::is_symlink(tmp.path() / step_file_name(0)));
}

// The regular .partial file a killed writer left is replaced by a new file (not written into).
TEST(CrashSafety, StalePartialFileIsReplaced) {
  const testing::TempDir tmp;
  fs::path partial = tmp.path() / step_file_name(0);
  partial += ".partial";
  testing::write_file(partial, "left by a writer killed mid-step");
  const testing::FixtureStep content = testing::fixture_step(0, 4096);
  {
    StepWriter writer(tmp.path(), 0, {});
    writer.write(content.records);
    writer.commit();
  }
  EXPECT_FALSE(fs::exists(partial));
  expect_step_intact(tmp.path() / step_file_name(0), 0, 4096);
}

}  // namespace
}  // namespace dynaprobe::formats
