// qkv search's corpus: read_apt_lists on the fixture lists (tests/search/lists,
// real stanzas of Debian 12, made by make_fixture.py) and on lists written
// here, document_text and words. Expected values are copied from the lists'
// text by hand, never produced by the code under test.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "search/corpus.h"
#include "search_testing.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;
using Strings = std::vector<std::string>;

using testing::kFixture;

using testing::TempDir;

const Package* find(const std::vector<Package>& packages, const std::string& name) {
  for (const Package& p : packages)
    if (p.name == name) return &p;
  return nullptr;
}

using testing::contains;
using testing::error_of;

// ---- the fixture -------------------------------------------------------------

TEST(Corpus, FixtureHasEveryPackageOnceSortedByName) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  // 274 stanzas in the bookworm list (make_fixture.py's count); openssh-client
  // is in the -updates list as well and counts once.
  ASSERT_EQ(packages.size(), 274u);
  for (size_t i = 1; i < packages.size(); ++i)
    ASSERT_LT(packages[i - 1].name, packages[i].name) << "at " << i;
  for (const char* name :
       {"gnuplot", "gnuplot-nox", "gnuplot-qt", "sqlite3", "python3-numpy", "libsqlite3-dev", "lz4",
        "curl", "vim", "emacs", "git", "openmpi-bin", "r-base", "octave", "openssh-client", "sl"})
    EXPECT_NE(find(packages, name), nullptr) << name;
  // Every fixture package has a short description and a section.
  for (const Package& p : packages) {
    EXPECT_FALSE(p.short_description.empty()) << p.name;
    EXPECT_FALSE(p.section.empty()) << p.name;
  }
}

TEST(Corpus, FieldsOfOnePackage) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  const Package* p = find(packages, "gnuplot-nox");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->short_description, "Command-line driven interactive plotting program. No-X package");
  EXPECT_EQ(p->section, "math");
  // Tag over three lines in the list.
  EXPECT_EQ(p->tags, (Strings{"field::mathematics", "implemented-in::c", "interface::commandline",
                              "role::program", "scope::application", "use::converting",
                              "works-with::image", "works-with::image:vector"}));
  // Three paragraphs: " ." lines are empty lines, the one leading space gone.
  EXPECT_EQ(p->long_description,
            "Gnuplot is a portable command-line driven interactive data and function\n"
            "plotting utility that supports lots of output formats, including drivers\n"
            "for many printers, (La)TeX, (x)fig, Postscript, and so on. The X11-output\n"
            "is packaged in gnuplot-x11. The QT-output is packaged in gnuplot-qt.\n"
            "\n"
            "Data files and self-defined functions can be manipulated by the internal\n"
            "C-like language. Can perform smoothing, spline-fitting, or nonlinear fits,\n"
            "and can work with complex numbers.\n"
            "\n"
            "This package is for working without an X server.");
}

TEST(Corpus, PackageWithoutTagsOrTranslation) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  const Package* lz4 = find(packages, "lz4");  // no Tag field
  ASSERT_NE(lz4, nullptr);
  EXPECT_TRUE(lz4->tags.empty());
  EXPECT_EQ(lz4->section, "utils");
  EXPECT_EQ(lz4->short_description, "Fast LZ compression algorithm library - tool");
  EXPECT_EQ(lz4->long_description.substr(0, 40), "LZ4 is a very fast lossless compression ");
  EXPECT_TRUE(contains(lz4->long_description, "systems.\n\nThis package contains"));
  // sl: make_fixture.py left its Translation-en stanza out.
  const Package* sl = find(packages, "sl");
  ASSERT_NE(sl, nullptr);
  EXPECT_EQ(sl->short_description, "Correct you if you type `sl' by mistake");
  EXPECT_EQ(sl->long_description, "");
  EXPECT_EQ(sl->tags, (Strings{"game::toys", "interface::text-mode", "role::program",
                               "uitoolkit::ncurses", "use::entertaining"}));
}

// ---- lists written here --------------------------------------------------------

// One Packages stanza.
std::string stanza(const std::string& name, const std::string& version,
                   const std::string& short_text, const std::string& md5,
                   const std::string& section = "utils") {
  return "Package: " + name + "\nVersion: " + version + "\nDescription: " + short_text +
         "\nDescription-md5: " + md5 + "\nSection: " + section + "\n\n";
}
std::string translation(const std::string& name, const std::string& md5, const std::string& text) {
  return "Package: " + name + "\nDescription-md5: " + md5 + "\nDescription-en: " + text + "\n\n";
}

TEST(Corpus, HighestVersionWinsWhateverTheListOrder) {
  TempDir dir;
  // apt's ordering: an epoch beats any upstream version, '~' sorts before
  // everything (1.0~rc1 < 1.0), "+deb12u1" after the plain revision.
  dir.write("a_dists_x_main_binary-amd64_Packages",
            stanza("epoch", "1:0.9-1", "epoch one", "e1") +
                stanza("tilde", "1.0~rc1-1", "tilde rc", "t1") +
                stanza("point", "2.0-1+deb12u1", "point update", "p2") +
                stanza("same", "3.0-1", "same first", "s1"));
  dir.write("b_dists_x-updates_main_binary-amd64_Packages",
            stanza("epoch", "2.0-1", "epoch none", "e2") +
                stanza("tilde", "1.0-1", "tilde final", "t2") +
                stanza("point", "2.0-1", "point plain", "p1") +
                stanza("same", "3.0-1", "same second", "s2"));
  dir.write("a_dists_x_main_i18n_Translation-en",
            translation("epoch", "e1", "epoch one\n long one") +
                translation("epoch", "e2", "epoch none\n long none") +
                translation("tilde", "t2", "tilde final\n long final") +
                translation("point", "p1", "point plain\n long plain"));
  const std::vector<Package> packages = read_apt_lists(dir.path());
  ASSERT_EQ(packages.size(), 4u);
  EXPECT_EQ(packages[0].name, "epoch");
  EXPECT_EQ(packages[0].short_description, "epoch one");
  EXPECT_EQ(packages[0].long_description, "long one");  // joined on the winner's md5
  EXPECT_EQ(packages[1].name, "point");
  EXPECT_EQ(packages[1].short_description, "point update");
  EXPECT_EQ(packages[1].long_description, "");  // its md5 (p2) has no translation
  EXPECT_EQ(packages[2].name, "same");
  EXPECT_EQ(packages[2].short_description, "same first");  // equal versions: the first list's
  EXPECT_EQ(packages[3].name, "tilde");
  EXPECT_EQ(packages[3].short_description, "tilde final");
  EXPECT_EQ(packages[3].long_description, "long final");
}

TEST(Corpus, DescriptionParagraphsAndVerbatimLines) {
  TempDir dir;
  dir.write("x_Packages",
            stanza("pkg", "1", "short", "m") + stanza("other", "1", "other short", "o"));
  // A " ." paragraph break, a verbatim line (two leading spaces keep one),
  // trailing spaces dropped, a section with its archive area.
  dir.write("x_i18n_Translation-en",
            translation("pkg", "m", "short\n first para\n continues   \n .\n second\n   indented") +
                translation("other", "o", "other short"));
  const std::vector<Package> packages = read_apt_lists(dir.path());
  ASSERT_EQ(packages.size(), 2u);
  EXPECT_EQ(packages[1].name, "pkg");
  EXPECT_EQ(packages[1].long_description, "first para\ncontinues\n\nsecond\n  indented");
  EXPECT_EQ(packages[0].long_description, "");  // a Description-en of one line
}

TEST(Corpus, CompressedListsAreRead) {
  TempDir dir;
  dir.write("x_Packages", stanza("zz", "1", "zz short", "z"));
  dir.write("x_i18n_Translation-en", translation("zz", "z", "zz short\n zz long"));
  ASSERT_EQ(
      std::system(
          ("lz4 -q --rm " + dir.file("x_Packages") + " " + dir.file("x_Packages.lz4")).c_str()),
      0);
  ASSERT_EQ(std::system(("gzip " + dir.file("x_i18n_Translation-en")).c_str()), 0);
  const std::vector<Package> packages = read_apt_lists(dir.path());
  ASSERT_EQ(packages.size(), 1u);
  EXPECT_EQ(packages[0].short_description, "zz short");
  EXPECT_EQ(packages[0].long_description, "zz long");
}

TEST(Corpus, DirectoryWithoutListsIsAnError) {
  TempDir dir;
  std::string message = error_of([&] { read_apt_lists(dir.path()); });
  EXPECT_TRUE(contains(message, "read_apt_lists: no Packages lists")) << message;
  EXPECT_TRUE(contains(message, dir.path())) << message;

  dir.write("x_Packages", stanza("a", "1", "a", "a"));
  dir.write("x_Packages.diff_Index", "not a list\n");  // apt's pdiff index is no list
  message = error_of([&] { read_apt_lists(dir.path()); });
  EXPECT_TRUE(contains(message, "no Translation-en lists")) << message;
  EXPECT_TRUE(contains(message, dir.path())) << message;
  EXPECT_TRUE(contains(message, "apt-get update -o Acquire::Languages=en")) << message;

  message = error_of([&] { read_apt_lists(dir.file("missing")); });
  EXPECT_TRUE(contains(message, "read_apt_lists")) << message;
  EXPECT_TRUE(contains(message, dir.file("missing"))) << message;
}

TEST(Corpus, CorruptListIsAnErrorNamingTheFile) {
  TempDir dir;
  std::string packages;
  for (int i = 0; i < 3000; ++i)
    packages += stanza("p" + std::to_string(i), "1", "short text of a package", "m");
  dir.write("x_Packages", packages);
  dir.write("x_i18n_Translation-en", translation("p1", "m", "short\n long"));
  ASSERT_EQ(
      std::system(
          ("lz4 -q --rm " + dir.file("x_Packages") + " " + dir.file("x_Packages.lz4")).c_str()),
      0);
  ASSERT_EQ(read_apt_lists(dir.path()).size(), 3000u);  // intact, it reads

  // Truncated to half its size.
  const std::string lz4 = dir.file("x_Packages.lz4");
  fs::resize_file(lz4, fs::file_size(lz4) / 2);
  std::string message = error_of([&] { read_apt_lists(dir.path()); });
  EXPECT_TRUE(contains(message, "read_apt_lists: cannot read the apt list " + lz4)) << message;

  // Garbage bytes with a compressor's name.
  fs::remove(lz4);
  dir.write("x_Packages.xz", std::string("\xfd"
                                         "7zXZ\0garbage garbage garbage",
                                         24));
  message = error_of([&] { read_apt_lists(dir.path()); });
  EXPECT_TRUE(contains(message, dir.file("x_Packages.xz"))) << message;

  // A list that is not deb822 at all (a binary blob, uncompressed).
  fs::remove(dir.file("x_Packages.xz"));
  std::string blob(70000, '\0');
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<char>(i * 7919 % 251);
  dir.write("x_Packages", blob);
  message = error_of([&] { read_apt_lists(dir.path()); });
  EXPECT_TRUE(contains(message, dir.file("x_Packages"))) << message;
}

TEST(Corpus, DefaultListsDirIsAptsOwn) {
  // Debian's default Dir::State::lists; this machine's apt.conf does not move it.
  EXPECT_EQ(fs::path(default_lists_dir()).lexically_normal(), fs::path("/var/lib/apt/lists/"));
}

// ---- document_text and words ---------------------------------------------------

TEST(Corpus, DocumentText) {
  Package p;
  p.name = "libstdc++6.0-dev";
  p.long_description = "Line one.\n\nLine two.";
  p.section = "contrib/utils";
  p.tags = {"implemented-in::c", "works-with::image:vector", "role::program"};
  const DocumentText t = document_text(p);
  EXPECT_EQ(t.name, "libstdc++6.0-dev libstdc 6 0 dev");
  EXPECT_EQ(t.description, "Line one.\n\nLine two.");
  EXPECT_EQ(t.section, "utils");
  EXPECT_EQ(t.tags, "implemented in c, works with image:vector, role program");

  Package plain;
  plain.name = "vim";
  plain.section = "editors";
  const DocumentText u = document_text(plain);
  EXPECT_EQ(u.name, "vim");
  EXPECT_EQ(u.description, "");
  EXPECT_EQ(u.section, "editors");
  EXPECT_EQ(u.tags, "");
}

TEST(Corpus, Words) {
  EXPECT_EQ(words(""), Strings{});
  EXPECT_EQ(words("  ,;- "), Strings{});
  EXPECT_EQ(words("Command-line driven PLOTTING"),
            (Strings{"command", "line", "driven", "plotting"}));
  EXPECT_EQ(words("c++ and g++, libstdc++6"), (Strings{"c++", "and", "g++", "libstdc++6"}));
  EXPECT_EQ(words("+x a+b ++"), (Strings{"x", "a+b"}));  // '+' does not start a word
  EXPECT_EQ(words("x86_64 ipv6 2024"), (Strings{"x86", "64", "ipv6", "2024"}));
  // UTF-8 bytes separate words: "café" -> "caf", "naïve" -> "na", "ve".
  EXPECT_EQ(words("caf\xc3\xa9 na\xc3\xafve \xe2\x80\x94 ok"), (Strings{"caf", "na", "ve", "ok"}));
  EXPECT_EQ(words("(La)TeX"), (Strings{"la", "tex"}));
}

}  // namespace
}  // namespace qkv::search
