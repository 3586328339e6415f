// Errors raised by k3ref. Every message names what was wrong (the argument, the file,
// the tensor) so a user never has to guess; nothing in the library aborts on bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace k3ref {

// A caller passed something the mathematics does not accept: a wrong shape, an option
// out of range, an inconsistent combination. The message starts with the function and
// names the argument.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A file could not be read or written, or its contents are malformed. The message names
// the file and, where one is involved, the tensor.
class FileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace k3ref
