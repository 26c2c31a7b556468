// What the subcommands share: errors mapped to exit codes, report files written safely.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <ostream>
#include <streambuf>
#include <vector>

#include "cli.h"
#include "dynaprobe/analyze/run_folders.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::cli {
namespace fs = std::filesystem;

Failure failure_of(std::exception_ptr error, const std::string& reading) {
  try {
    std::rethrow_exception(error);
  } catch (const CliError& e) {
    return {e.exit_code(), e.what()};
  } catch (const UsageError& e) {
    return {kExitUsage, e.what()};
  } catch (const Error& e) {  // FormatError, IoError
    return {kExitIo, e.what()};
  } catch (const std::bad_alloc&) {
    return {kExitIo, "out of memory while reading " + reading +
                         "; the file is damaged (a size in it is absurd), or give the reader "
                         "more memory with --memory-limit MIB"};
  } catch (const std::exception& e) {
    return {kExitIo, std::string("internal error while reading ") + reading + ": " + e.what() +
                         "; this is a bug in dynaprobe: please report it with the command line "
                         "and, if you can, the dump"};
  } catch (...) {
    return {kExitIo, "internal error while reading " + reading +
                         " (an exception of unknown type); this is a bug in dynaprobe: please "
                         "report it with the command line and, if you can, the dump"};
  }
}

namespace {

// The bytes of a report file, written to its descriptor in 64 KiB pieces; the first error is kept
// for close() to report.
class FileBuffer : public std::streambuf {
 public:
  explicit FileBuffer(int fd) : fd_(fd), buffer_(1 << 16) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  int error() const { return error_; }

 protected:
  int_type overflow(int_type c) override {
    if (!flush_buffer()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override { return flush_buffer() ? 0 : -1; }

 private:
  bool flush_buffer() {
    const char* at = pbase();
    while (at < pptr() && error_ == 0) {
      const ssize_t n = ::write(fd_, at, static_cast<std::size_t>(pptr() - at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) error_ = n < 0 ? errno : EIO;
      if (n > 0) at += n;
    }
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return error_ == 0;
  }

  int fd_;
  std::vector<char> buffer_;
  int error_ = 0;
};

}  // namespace

struct OutputFile::Open {
  int fd;
  FileBuffer buffer;
  std::ostream stream;
  explicit Open(int descriptor) : fd(descriptor), buffer(descriptor), stream(&buffer) {}
};

OutputFile::OutputFile(fs::path path) : path_(std::move(path)) {
  if (path_.has_parent_path()) {
    std::error_code error;
    fs::create_directories(path_.parent_path(), error);
  }
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int code = errno;
    throw IoError("cannot write " + path_.string() + ": " +
                  (code == ELOOP ? std::string("it is a symbolic link, which dynaprobe does not "
                                               "follow; remove it")
                                 : std::string(std::strerror(code))));
  }
  open_ = std::make_unique<Open>(fd);
}

OutputFile::~OutputFile() {
  if (open_) ::close(open_->fd);
}

std::ostream& OutputFile::stream() { return open_->stream; }

void OutputFile::close() {
  open_->stream.flush();
  int error = open_->buffer.error();
  if (::close(open_->fd) != 0 && error == 0) error = errno;
  open_.reset();
  if (error != 0) throw IoError("cannot write " + path_.string() + ": " + std::strerror(error));
}

void write_text_file(const fs::path& path, const std::string& text) {
  OutputFile file(path);
  file.stream() << text;
  file.close();
}

const char* printable(const std::string& name) {
  static thread_local std::string buffer;
  buffer = formats::printable_name(name);
  return buffer.c_str();
}

}  // namespace dynaprobe::cli

namespace dynaprobe::cli {

CLI::Validator non_negative(const std::string& example, bool integer) {
  const std::string expected = integer ? "an integer >= 0" : "a finite number >= 0";
  return CLI::Validator(
      [expected, example, integer](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double value = integer ? static_cast<double>(std::strtoll(text.c_str(), &end, 10))
                                     : std::strtod(text.c_str(), &end);
        const bool whole = !text.empty() && end == text.c_str() + text.size();
        const bool ok = whole && errno == 0 && std::isfinite(value) && value >= 0;
        if (ok) return {};
        return "expected " + expected + " (such as " + example + "), but received '" +
               formats::printable_name(text) + "'";
      },
      integer ? "N >= 0" : "X >= 0", "non-negative");
}

std::string chosen_dump(const std::string& command, const std::string& path) {
  const analyze::ChosenRun chosen = analyze::choose_run(command, path);
  if (!chosen.said.empty()) std::fprintf(stderr, "%s\n", chosen.said.c_str());
  return chosen.path.string();
}

}  // namespace dynaprobe::cli
