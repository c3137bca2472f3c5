// Tests of the one output writer (qkv/staged_file.h) behind write_npy, the
// figures and the qkv command: paths checked before any work, all-or-nothing
// writes of several files, a failing rename or disk that leaves no temporary
// file, devices written through, and remove_staged_files() for signal handlers.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "test_util.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

class StagedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/qkv-staged-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::set<std::string> entries(const fs::path& dir) const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename());
    return names;
  }
  std::set<std::string> entries() const { return entries(dir_); }

  static std::string read(const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  static void write(const std::string& file, const std::string& bytes) {
    std::ofstream(file, std::ios::binary) << bytes;
  }

  fs::path dir_;
};

TEST_F(StagedFileTest, PathsAreCheckedBeforeAnyWork) {
  expect_error([&] { check_output_path("f", "--out", ""); }, {"f: --out \"\"", "empty"});
  expect_error([&] { check_output_path("f", "--out", dir_.string()); },
               {"f: --out " + dir_.string(), "is a directory"});
  const std::string nowhere = path("no/such/out.npy");
  expect_error([&] { check_output_path("f", "--out", nowhere); },
               {"f: --out " + nowhere, "cannot create a file in " + path("no/such"),
                "No such file or directory"});
  write(path("file"), "x");
  expect_error([&] { check_output_path("f", "", path("file/out.npy")); },
               {"f: " + path("file/out.npy"), "Not a directory"});
  fs::create_symlink("loop", path("loop"));
  expect_error([&] { check_output_path("f", "", path("loop")); }, {"symbolic links"});
  check_output_path("f", "--out", path("fine.npy"));
  check_output_path("f", "--out", "/dev/null");
  EXPECT_EQ(entries(), (std::set<std::string>{"file", "loop"}));
}

TEST_F(StagedFileTest, TwoOutputsLeadingToOneFileAreAnError) {
  fs::create_directory(path("sub"));
  fs::create_symlink("sub/a.npy", path("link.npy"));
  expect_error(
      [&] {
        check_output_paths("f", {{"--out", path("sub/a.npy")}, {"--weights", path("link.npy")}});
      },
      {"f: --out and --weights name the same file"});
  expect_error(
      [&] {
        check_output_paths("f", {{"--out", path("a.npy")}, {"--lse", path("sub/../a.npy")}});
      },
      {"--out and --lse"});
  // A device may take several outputs (all discarded).
  check_output_paths("f", {{"--out", "/dev/null"}, {"--weights", "/dev/null"}});
}

TEST_F(StagedFileTest, UncommittedFilesLeaveNothing) {
  write(path("keep"), "old");
  {
    StagedFile file("f", "", path("keep"));
    file.write("new content");
    file.finish();
    EXPECT_EQ(entries().size(), 2u) << "the temporary file is beside the destination";
  }
  EXPECT_EQ(read(path("keep")), "old");
  EXPECT_EQ(entries(), std::set<std::string>{"keep"});
}

TEST_F(StagedFileTest, ARenameFailureRemovesTheTemporaryFile) {
  const std::string dest = path("taken");
  StagedFile file("f", "--out", dest);
  file.write("data");
  // The destination becomes a non-empty directory after it was checked.
  fs::create_directory(dest);
  write(dest + "/inside", "x");
  expect_io_error([&] { file.commit(); },
                  {"f: --out " + dest, "cannot rename the finished file into place"});
  EXPECT_EQ(entries(), std::set<std::string>{"taken"});
  EXPECT_EQ(read(dest + "/inside"), "x");
}

TEST_F(StagedFileTest, WriteFilesIsAllOrNothing) {
  write(path("a.npy"), "old a");
  const std::vector<OutputBytes> files{{"--out", path("a.npy"), "new"},
                                       {"--weights", path("b.npy"), "a longer second file"}};
  {
    // The first file fits, the second does not: neither is written.
    FileSizeLimit limit(4);
    expect_io_error([&] { write_files("", files); },
                    {"--weights " + path("b.npy"), "File too large"});
  }
  EXPECT_EQ(entries(), std::set<std::string>{"a.npy"});
  EXPECT_EQ(read(path("a.npy")), "old a");
  write_files("", files);
  EXPECT_EQ(read(path("a.npy")), "new");
  EXPECT_EQ(read(path("b.npy")), "a longer second file");
  EXPECT_EQ(entries(), (std::set<std::string>{"a.npy", "b.npy"}));
}

TEST_F(StagedFileTest, AFullDeviceIsAnIoErrorAndStaysADevice) {
  // /dev/full fails every write with ENOSPC; as root a private copy of it.
  std::string full = "/dev/full";
  if (::geteuid() == 0) {
    full = path("full");
    ASSERT_EQ(::mknod(full.c_str(), S_IFCHR | 0666, makedev(1, 7)), 0) << std::strerror(errno);
  }
  expect_io_error(
      [&] {
        write_files("", {{"--out", full, "bytes"}});
      },
      {"--out " + full, "No space left on device"});
  struct stat st;
  ASSERT_EQ(::stat(full.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST_F(StagedFileTest, RemoveStagedFilesUnlinksEveryLiveTemporary) {
  // What the qkv command's SIGTERM handler calls before dying of the signal.
  StagedFile a("f", "", path("a"));
  StagedFile b("f", "", path("b"));
  a.write("x");
  EXPECT_EQ(entries().size(), 2u);
  remove_staged_files();
  EXPECT_TRUE(entries().empty());
  StagedFile c("f", "", path("c"));  // staging goes on as before
  c.write("y");
  c.commit();
  EXPECT_EQ(entries(), std::set<std::string>{"c"});
}

// A handler as the qkv command's: it returns at once while a window is open.
std::vector<std::pair<int, bool>> handled;  // the signal, and whether it was deferred
void recording_handler(int signal_number) {
  handled.push_back({signal_number, defer_signal(signal_number)});
}

TEST(SignalWindow, HoldsASignalUntilTheLastWindowCloses) {
  struct sigaction action {
  }, old{};
  action.sa_handler = recording_handler;
  sigemptyset(&action.sa_mask);
  ASSERT_EQ(::sigaction(SIGUSR1, &action, &old), 0);
  handled.clear();
  ::raise(SIGUSR1);  // no window: the handler goes on
  EXPECT_EQ(handled, (std::vector<std::pair<int, bool>>{{SIGUSR1, false}}));
  handled.clear();
  {
    const SignalWindow outer;
    {
      const SignalWindow inner;
      ::raise(SIGUSR1);
      EXPECT_EQ(handled, (std::vector<std::pair<int, bool>>{{SIGUSR1, true}}));
    }
    EXPECT_EQ(handled.size(), 1u);  // the outer window still holds it
  }
  // Raised again as the last window closed, and handled then.
  EXPECT_EQ(handled, (std::vector<std::pair<int, bool>>{{SIGUSR1, true}, {SIGUSR1, false}}));
  handled.clear();
  { const SignalWindow window; }  // nothing held: nothing raised
  EXPECT_TRUE(handled.empty());
  ::sigaction(SIGUSR1, &old, nullptr);
}

TEST_F(StagedFileTest, NewFilesGetTheUmaskAndExistingOnesKeepTheirMode) {
  const mode_t old = ::umask(027);
  write_files("", {{"", path("new"), "x"}});
  ::umask(old);
  struct stat st;
  ASSERT_EQ(::stat(path("new").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ASSERT_EQ(::chmod(path("new").c_str(), 0604), 0);
  write_files("", {{"", path("new"), "y"}});
  ASSERT_EQ(::stat(path("new").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0604u);
}

}  // namespace
}  // namespace qkv::test
