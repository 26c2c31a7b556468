// What the subcommands share: errors mapped to exit codes, report files written safely.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "cli.h"
#include "dynaprobe/analyze/engine.h"
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

void write_text_file(const fs::path& path, const std::string& text) {
  if (path.has_parent_path()) {
    std::error_code error;
    fs::create_directories(path.parent_path(), error);
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int code = errno;
    throw IoError("cannot write " + path.string() + ": " +
                  (code == ELOOP ? std::string("it is a symbolic link, which dynaprobe does not "
                                               "follow; remove it")
                                 : std::string(std::strerror(code))));
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string reason = std::strerror(errno);
      ::close(fd);
      throw IoError("cannot write " + path.string() + ": " + reason);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) {
    throw IoError("cannot write " + path.string() + ": " + std::strerror(errno));
  }
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
  const analyze::NewestRun newest = analyze::newest_run(path);
  if (newest.runs.empty()) return path;
  constexpr std::size_t kShown = 4;
  std::string said = "dynaprobe: " + path + " holds " + std::to_string(newest.runs.size()) +
                     " run(s); " + command + " reads the newest, " + newest.path.string();
  for (std::size_t i = 1; i < newest.runs.size() && i <= kShown; ++i) {
    said += (i > 1 ? ", " : "; the others: ") + newest.runs[i].filename().string();
  }
  if (newest.runs.size() > kShown + 1) said += ", ...";
  if (newest.runs.size() > 1) {
    said += " (name one to read it: dynaprobe " + command + " " +
            (fs::path(path) / newest.runs[1].filename()).string() + ")";
  }
  std::fprintf(stderr, "%s\n", formats::printable_name(said).c_str());
  return newest.path.string();
}

std::string human_bytes(std::uint64_t bytes) {
  char buffer[32];
  if (bytes < 1024) {
    std::snprintf(buffer, sizeof(buffer), "%llu B", static_cast<unsigned long long>(bytes));
  } else if (bytes < (1u << 20)) {
    std::snprintf(buffer, sizeof(buffer), "%.1f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes < (1u << 30)) {
    std::snprintf(buffer, sizeof(buffer), "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return buffer;
}

}  // namespace dynaprobe::cli
