#include "k3ref/io/sha256.h"

#include "test_support.h"
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "k3ref/error.h"

namespace k3ref::io {
namespace {

std::string sha256_of(std::string_view text) {
  return sha256_hex(std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

// FIPS 180-4 example vectors (NIST "SHA256.pdf" examples, and the one-million-'a' test of
// FIPS 180-2 Appendix B.3).
TEST(Sha256, EmptyMessage) {
  EXPECT_EQ(sha256_of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, EmptySpanWithANullPointer) {
  // An empty file's bytes: a default-constructed span, whose data() is null. A null pointer
  // must not reach the hashing library's copy, where it is undefined even for 0 bytes.
  EXPECT_EQ(sha256_hex(std::span<const std::uint8_t>()), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex(std::vector<std::uint8_t>()), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, Abc) {
  EXPECT_EQ(sha256_of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, FourHundredFortyEightBitMessage) {
  EXPECT_EQ(sha256_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, EightHundredNinetySixBitMessage) {
  EXPECT_EQ(sha256_of("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopq"
                      "rstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

TEST(Sha256, OneMillionA) {
  EXPECT_EQ(sha256_of(std::string(1'000'000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Lengths on either side of the padding boundaries (55/56 bytes: length field fits in the
// last block or not; 64: exactly one block; 119/120: the same one block later).
TEST(Sha256, PaddingBoundaries) {
  EXPECT_EQ(sha256_of(std::string(55, 'a')), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_of(std::string(56, 'a')), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha256_of(std::string(63, 'a')), "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34");
  EXPECT_EQ(sha256_of(std::string(64, 'a')), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
  EXPECT_EQ(sha256_of(std::string(119, 'a')), "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb");
  EXPECT_EQ(sha256_of(std::string(120, 'a')), "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c");
}

class Sha256File : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() /
                 ("k3ref_sha256_test_" + std::to_string(::getpid()) + "_" +
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(directory_);
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  std::filesystem::path write(const std::string& name, const std::string& contents) {
    const std::filesystem::path path = directory_ / name;
    std::ofstream(path, std::ios::binary) << contents;
    return path;
  }

  std::filesystem::path directory_;
};

// The file is read in 64 KiB chunks: a million bytes crosses many chunk boundaries, none
// of them block-aligned with the message in a special way.
TEST_F(Sha256File, MatchesInMemoryDigest) {
  EXPECT_EQ(sha256_file_hex(write("million_a", std::string(1'000'000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(sha256_file_hex(write("empty", "")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  std::string odd_sized(65536 * 2 + 17, '\0');
  for (std::size_t i = 0; i < odd_sized.size(); ++i) odd_sized[i] = static_cast<char>(i * 131 + 7);
  EXPECT_EQ(sha256_file_hex(write("odd", odd_sized)), sha256_of(odd_sized));
}

// A pipe hands read() whatever the writer has flushed, so the hasher is fed pieces that
// are not multiples of the 64-byte block and must carry partial blocks between calls.
TEST_F(Sha256File, ShortReadsFromAPipe) {
  const std::filesystem::path fifo = directory_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string message(10'007, '\0');
  for (std::size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>(i * 37 + 11);
  std::thread writer([&] {
    std::ofstream out(fifo, std::ios::binary);
    for (std::size_t i = 0; i < message.size(); i += 997) {
      out.write(message.data() + i, static_cast<std::streamsize>(std::min<std::size_t>(997, message.size() - i)));
      out.flush();
    }
  });
  const std::string digest = sha256_file_hex(fifo);
  writer.join();
  EXPECT_EQ(digest, sha256_of(message));
}

TEST_F(Sha256File, MissingFileNamesTheFile) {
  const std::filesystem::path missing = directory_ / "no_such_file.bin";
  try {
    sha256_file_hex(missing);
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(missing.string()), std::string::npos) << e.what();
  }
}

TEST_F(Sha256File, DirectoryIsAnErrorNamingIt) {
  try {
    sha256_file_hex(directory_);
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(directory_.string()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace k3ref::io
