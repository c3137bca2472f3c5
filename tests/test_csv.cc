// The qkv command's CSV reader (cli/csv.h): what it accepts, the numbers it
// reads, that every malformed file is a qkv::Error naming line and column, and
// that a stream holding a NUL byte is refused without being read to its end.
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "csv.h"
#include "qkv/error.h"

namespace qkv::cli {
namespace {

std::vector<double> numbers_of(const std::string& text, const std::vector<int>& columns) {
  return CsvFile(text, "t.csv").numbers(columns).values();
}

// Parsing `text` (and reading `columns`) throws qkv::Error holding every fragment.
void expect_error(const std::string& text, const std::vector<int>& columns,
                  const std::vector<std::string>& fragments) {
  SCOPED_TRACE("csv: " + text);
  try {
    CsvFile(text, "t.csv").numbers(columns);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("t.csv: ", 0), 0u) << message;
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message: " << message << "\nmissing: " << fragment;
    }
  }
}

TEST(Csv, ReadsHeaderAndSelectedColumnsInOrder) {
  const CsvFile csv("x,y,z\n1,2,3\n4,5,6\n", "t.csv");
  EXPECT_EQ(csv.columns(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(csv.find("z"), 2);
  EXPECT_FALSE(csv.find("w"));
  const Tensor<double> t = csv.numbers({2, 0});
  EXPECT_EQ(t.shape(), (Shape{2, 2}));
  EXPECT_EQ(t.values(), (std::vector<double>{3, 1, 6, 4}));
}

TEST(Csv, WhitespaceLineEndsBomBlankLinesAndNoFinalNewline) {
  const std::string text = "\xEF\xBB\xBF x ,\ty\r\n\r\n 1.5 , -2e3 \r\n  \n\t\n+0.25,.5";
  const CsvFile csv(text, "t.csv");
  EXPECT_EQ(csv.columns(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(csv.numbers({0, 1}).values(), (std::vector<double>{1.5, -2000, 0.25, 0.5}));
}

TEST(Csv, QuotedHeaderNamesWithCommasQuotesAndLineBreaks) {
  const CsvFile csv("\"a, b\",  \"say \"\"hi\"\"\" ,\"two\nlines\"\n1,2,3\n", "t.csv");
  EXPECT_EQ(csv.columns(), (std::vector<std::string>{"a, b", "say \"hi\"", "two\nlines"}));
  EXPECT_EQ(csv.numbers({0, 1, 2}).values(), (std::vector<double>{1, 2, 3}));
  // Line numbers count the line break inside the quoted name.
  expect_error("\"two\nlines\",y\n1,2\n3,x\n", {0, 1}, {"line 4, column 2 (\"y\")"});
}

TEST(Csv, QuotedNumbersAndUnreadColumnsOfText) {
  EXPECT_EQ(numbers_of("name,x\nfoo,\"1\"\n\"b,ar\",2\n", {1}), (std::vector<double>{1, 2}));
}

TEST(Csv, ExactDecimalRoundTrip) {
  const double x = 0.1 + 0.2;
  char text[64];
  std::snprintf(text, sizeof text, "x\n%.17g\n", x);
  EXPECT_EQ(numbers_of(text, {0}), std::vector<double>{x});
}

TEST(Csv, UnderflowReadsAsZeroOverflowIsAnError) {
  EXPECT_EQ(numbers_of("x\n1e-400\n", {0}), std::vector<double>{0.0});
  expect_error("x\n1e999\n", {0}, {"line 2, column 1 (\"x\")", "\"1e999\" is not finite"});
}

TEST(Csv, NonNumbersNameLineAndColumn) {
  expect_error("x,y,price\n1,2,3\n4,5,abc\n", {0, 1, 2},
               {"t.csv: line 3, column 3 (\"price\"): \"abc\" is not a number"});
  for (const char* bad : {"0x10", "1,5e", "--1", "+-1", "1 2", "1e", "e5", "+", "."}) {
    SCOPED_TRACE(bad);
    const std::string quoted_cell = std::string("\"") + bad + "\"";
    expect_error("x\n" + quoted_cell + "\n", {0}, {"line 2, column 1", "is not a number"});
  }
}

TEST(Csv, NanInfAndEmptyCellsAreErrors) {
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "Infinity"}) {
    expect_error(std::string("x,y\n1,") + bad + "\n", {0, 1},
                 {"line 2, column 2 (\"y\")", std::string("\"") + bad + "\" is not"});
  }
  expect_error("x,y\n1,2\n,3\n", {0, 1}, {"line 3, column 1 (\"x\"): empty cell"});
  expect_error("x,y\n1,\n", {0, 1}, {"line 2, column 2 (\"y\"): empty cell"});
  expect_error("x,y\n1,\"\"\n", {0, 1}, {"line 2, column 2 (\"y\"): empty cell"});
}

TEST(Csv, RaggedRows) {
  expect_error("a,b,c\n1,2,3\n\n1,2\n", {0}, {"t.csv: line 4 has 2 fields but the header has 3"});
  expect_error("a,b\n1,2,3\n", {0}, {"line 2 has 3 fields but the header has 2"});
  expect_error("a,b\n1,2,\n", {0}, {"line 2 has 3 fields"});
  // Ragged rows are errors even where no selected column is missing.
  expect_error("a,b\n1,2\n7\n", {0}, {"line 3 has 1 field but the header has 2"});
}

TEST(Csv, MalformedQuotes) {
  expect_error("x,y\n1,\"2\n3,4\n", {0, 1}, {"line 2, column 2", "never closed"});
  expect_error("x,y\n1,2\"3\n", {0, 1}, {"line 2, column 2", "quote inside an unquoted field"});
  expect_error("x,y\n1,\"2\"3\n", {0, 1}, {"line 2, column 2", "after the closing quote"});
  expect_error("\"x\ny\n1\n", {0}, {"line 1, column 1", "never closed"});
}

TEST(Csv, BadHeaders) {
  expect_error("", {}, {"empty", "header"});
  expect_error("\n  \n", {}, {"empty", "header"});
  expect_error("x,y\n", {0}, {"no data rows"});
  expect_error("x,y\n\n\n", {0}, {"no data rows"});
  expect_error("x,,y\n1,2,3\n", {0}, {"line 1, column 2", "empty column name"});
  expect_error("x,y,\n1,2,3\n", {0}, {"line 1, column 3", "empty column name"});
  expect_error("x,y,x\n1,2,3\n", {0}, {"\"x\" appears twice", "columns 1 and 3"});
}

TEST(Csv, ReadMissingFile) {
  try {
    CsvFile::read("/nonexistent/qkv/data.csv");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/qkv/data.csv: cannot open"),
              std::string::npos)
        << e.what();
  }
}

TEST(Csv, ANulByteIsNotText) {
  expect_error(std::string("x,y\n1,2\n3,\0\n", 13), {0, 1},
               {"line 3", "NUL byte at byte offset 10", "a CSV file is text"});
  expect_error(std::string("\0x,y\n", 6), {0}, {"line 1", "NUL byte at byte offset 0"});
}

TEST(Csv, AStreamWithNulBytesFailsAtItsFirstChunk) {
  // Like /dev/zero, but bounded: a reader that read the whole stream before
  // looking at it would take all 64 MiB.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::atomic<size_t> written{0};
  std::thread writer([&] {
    sigset_t pipe_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, nullptr);  // EPIPE once the reader is gone
    const std::string zeros(65536, '\0');
    for (int i = 0; i < 1024; ++i) {
      const ssize_t n = ::write(fds[1], zeros.data(), zeros.size());
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
    ::close(fds[1]);
  });
  try {
    CsvFile::read(fds[0], "zeros.csv", "key,");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zeros.csv: line 1: a NUL byte at byte offset 4"),
              std::string::npos)
        << e.what();
  }
  ::close(fds[0]);
  writer.join();
  EXPECT_LT(written.load(), size_t{1} << 20) << "the reader kept reading after a NUL byte";
}

TEST(Csv, ANulByteInALaterChunkNamesItsLine) {
  // The line is counted from the start of the file once the NUL is found,
  // across the reader's 64 KiB chunks and the bytes consumed before it.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::string rest = "y\n";
  for (int i = 0; i < 30000; ++i) rest += "1,2\n";  // lines 2 to 30001, 120 KB
  rest += std::string("3,\0\n", 5);
  std::thread writer([&] {
    for (size_t done = 0; done < rest.size();) {
      const ssize_t n = ::write(fds[1], rest.data() + done, rest.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ::close(fds[1]);
  });
  try {
    CsvFile::read(fds[0], "late.csv", "x,");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("late.csv: line 30002: a NUL byte at byte offset 120006"),
              std::string::npos)
        << e.what();
  }
  ::close(fds[0]);
  writer.join();
}

TEST(Csv, MaxRowsIsAtLeastTheDataRows) {
  // Every line after the header; blank lines and line breaks inside quotes
  // make it more than the rows, never fewer.
  EXPECT_EQ(CsvFile("x,y\n1,2\n3,4\n", "t.csv").max_rows(), 3u);
  EXPECT_EQ(CsvFile("x,y\n1,2\n3,4", "t.csv").max_rows(), 2u);
  EXPECT_EQ(CsvFile("\n\nx,y\r\n\n1,2\r\n\n", "t.csv").max_rows(), 4u);
  EXPECT_EQ(CsvFile("\"a\nb\",y\n\"1\n2\",3\n", "t.csv").max_rows(), 3u);
  EXPECT_EQ(CsvFile("x,y\n", "t.csv").max_rows(), 1u);
  EXPECT_EQ(CsvFile("x,y", "t.csv").max_rows(), 1u);
}

TEST(Csv, ReadsAStreamWhoseFirstBytesWereConsumed) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string rest = "y\n1,2\n3,4\n";
  ASSERT_EQ(::write(fds[1], rest.data(), rest.size()), static_cast<ssize_t>(rest.size()));
  ::close(fds[1]);
  const CsvFile csv = CsvFile::read(fds[0], "p.csv", "x,");
  ::close(fds[0]);
  EXPECT_EQ(csv.columns(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(csv.numbers({0, 1}).values(), (std::vector<double>{1, 2, 3, 4}));
}

TEST(Csv, ParseNumber) {
  EXPECT_EQ(parse_number("1.5"), 1.5);
  EXPECT_EQ(parse_number("+2"), 2.0);
  EXPECT_EQ(parse_number("-3e-2"), -0.03);
  EXPECT_FALSE(parse_number(""));
  EXPECT_FALSE(parse_number(" 1"));
  EXPECT_FALSE(parse_number("1 "));
  EXPECT_FALSE(parse_number("+-1"));
  EXPECT_FALSE(parse_number("0x1p3"));
  EXPECT_TRUE(std::isnan(*parse_number("nan")));
  EXPECT_TRUE(std::isinf(*parse_number("1e400")));
}

TEST(Csv, FieldQuoting) {
  EXPECT_EQ(csv_field("price"), "price");
  EXPECT_EQ(csv_field("a, b"), "\"a, b\"");
  EXPECT_EQ(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
  EXPECT_EQ(csv_field(" x"), "\" x\"");
  EXPECT_EQ(csv_field(""), "\"\"");
  // What csv_field writes reads back as the same name.
  const std::vector<std::string> names{"a, b", "say \"hi\"", " x", "two\nlines"};
  std::string header;
  for (size_t i = 0; i < names.size(); ++i) header += (i ? "," : "") + csv_field(names[i]);
  EXPECT_EQ(CsvFile(header + "\n1,2,3,4\n", "t.csv").columns(), names);
}

}  // namespace
}  // namespace qkv::cli
