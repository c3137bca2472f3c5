// Directory plumbing shared by StagedFile, StagedDirectory and the key-value
// store. Private to the library.
#pragma once

#include <string>

namespace qkv {

// fsync(2) of a directory, so the renames in it are on disk; failures ignored
// (some file systems cannot sync a directory).
void sync_directory(const std::string& dir);

// The permissions open(2) or mkdir(2) give a new file or directory asked
// for with `mode`: `mode` minus the process's umask, read without changing
// it (umask(2) would change it for a moment in every thread).
unsigned mode_after_umask(unsigned mode);

}  // namespace qkv
