// io/file.h: printable excerpts of untrusted text, regular-file reading, output-path checks.
#include "k3ref/io/file.h"

#include "test_support.h"
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "k3ref/error.h"

namespace k3ref::io {
namespace {

namespace fs = std::filesystem;

TEST(Printable, EscapesEveryControlAndInvalidByteAndNothingElse) {
  EXPECT_EQ(printable("plain ascii, UTF-8 \xc3\xa9\xe4\xb8\xad"), "plain ascii, UTF-8 \xc3\xa9\xe4\xb8\xad");
  EXPECT_EQ(printable("a\nb\tc\x1b[2J\x7f"), "a\\x0ab\\x09c\\x1b[2J\\x7f");
  EXPECT_EQ(printable("csi \xc2\x9b" "31m"), "csi \\xc2\\x9b31m");           // 8-bit CSI (U+009B)
  EXPECT_EQ(printable("rlo \xe2\x80\xae!"), "rlo \\xe2\\x80\\xae!");          // U+202E reorders the line
  EXPECT_EQ(printable("bad \xff\xc0\xaf \xed\xa0\x80"), "bad \\xff\\xc0\\xaf \\xed\\xa0\\x80");
  EXPECT_EQ(printable(std::string("nul\0x", 5)), "nul\\x00x");
}

TEST(Printable, ExcerptCutsAtACharacterAndSaysHowLong) {
  EXPECT_EQ(excerpt("short"), "'short'");
  EXPECT_EQ(excerpt(std::string(100, 'x'), 10), "'xxxxxxxxxx'... (100 bytes)");
  // A 3-byte character straddling the cut is left out whole, never split.
  EXPECT_EQ(excerpt("abcdefghi\xe4\xb8\xad", 10), "'abcdefghi'... (12 bytes)");
  EXPECT_EQ(excerpt("\x1b\x1b\x1b", 2), "'\\x1b\\x1b'... (3 bytes)");
}

TEST(Utf8, FirstInvalidByte) {
  EXPECT_FALSE(first_invalid_utf8("ok \xf0\x9f\x98\x80"));
  EXPECT_EQ(first_invalid_utf8("ab\x80"), 2u);
  EXPECT_EQ(first_invalid_utf8("a\xe4\xb8"), 1u);  // truncated
  EXPECT_EQ(first_invalid_utf8("\xf4\x90\x80\x80"), 0u);  // above U+10FFFF
}

class FileChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("k3ref_file_test_" + std::to_string(::getpid()) + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "input") << "input bytes";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The message of check_output_path's FileError, or "" if it accepts.
  std::string refusal(const fs::path& path, bool force = false) {
    try {
      check_output_path(path, OutputCheck{{dir_ / "input"}, force, "--out"});
      return "";
    } catch (const FileError& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find('\n'), std::string::npos);
      EXPECT_NE(message.find("--out"), std::string::npos) << message;
      return message;
    }
  }
  fs::path dir_;
};

TEST_F(FileChecks, OutputPathRules) {
  EXPECT_EQ(refusal(dir_ / "new.safetensors"), "");
  std::ofstream(dir_ / "old.safetensors") << "x";
  EXPECT_EQ(refusal(dir_ / "old.safetensors"), "");  // a regular file: replaced atomically

  EXPECT_NE(refusal(dir_ / "input").find("is the input"), std::string::npos);
  fs::create_hard_link(dir_ / "input", dir_ / "hard_link");
  EXPECT_NE(refusal(dir_ / "hard_link").find("is the input"), std::string::npos);
  fs::create_symlink("input", dir_ / "link");
  EXPECT_NE(refusal(dir_ / "link").find("symbolic link"), std::string::npos);
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  EXPECT_NE(refusal(dir_ / "fifo").find("not a regular file"), std::string::npos);
  EXPECT_NE(refusal("/dev/null").find("not a regular file"), std::string::npos);
  EXPECT_NE(refusal(dir_ / "o\xff.safetensors").find("not valid UTF-8"), std::string::npos);
  EXPECT_NE(refusal(dir_ / "missing" / "o.safetensors").find("not usable"), std::string::npos);
  EXPECT_NE(refusal(dir_).find("is a directory"), std::string::npos);
  EXPECT_NE(refusal(dir_ / "input" / "o.safetensors").find("not a directory"), std::string::npos);

  // --force: the user asked for it (a directory is never writable as a file).
  for (const char* name : {"input", "hard_link", "link", "fifo", "o\xff.safetensors"})
    EXPECT_EQ(refusal(dir_ / name, true), "") << name;
  EXPECT_NE(refusal(dir_, true), "");
}

TEST_F(FileChecks, ReadRegularFileRefusesWhatIsNotOneAndBoundsTheSize) {
  EXPECT_EQ(read_regular_file(dir_ / "input", 100).size(), 11u);
  EXPECT_EQ(read_regular_file(dir_ / "input", 11).size(), 11u);  // exactly at the limit
  auto message = [](const fs::path& path, std::uint64_t limit) -> std::string {
    try {
      read_regular_file(path, limit);
      return "";
    } catch (const FileError& e) {
      return e.what();
    }
  };
  EXPECT_NE(message(dir_ / "input", 10).find("11 bytes, over the limit of 10"), std::string::npos);
  EXPECT_NE(message("/dev/zero", 1u << 30).find("is a character device"), std::string::npos);
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  ::alarm(20);  // a blocking open would hang here
  EXPECT_NE(message(dir_ / "fifo", 100).find("is a FIFO"), std::string::npos);
  ::alarm(0);
  EXPECT_NE(message(dir_, 100).find("is a directory"), std::string::npos);
  EXPECT_NE(message(dir_ / "missing", 100).find("cannot open"), std::string::npos);
  std::ofstream(dir_ / "empty");
  EXPECT_TRUE(read_regular_file(dir_ / "empty", 0).empty());
}

}  // namespace
}  // namespace k3ref::io
