// A dense N-d row-major tensor over any scalar. Deliberately small: the references
// index it with operator() and read its shape; storage is one std::vector.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "k3ref/error.h"

namespace k3ref {

using Shape = std::vector<std::int64_t>;

std::string shape_to_string(const Shape& shape);

// Number of elements; throws InvalidArgument naming `what` on a negative extent or on a
// count that does not fit in 63 bits.
std::int64_t checked_numel(const Shape& shape, const std::string& what);

template <class T>
class Tensor {
 public:
  using value_type = T;

  Tensor() = default;
  explicit Tensor(Shape shape, const T& fill = T(0))
      : shape_(std::move(shape)), data_(static_cast<std::size_t>(checked_numel(shape_, "Tensor")), fill) {
    compute_strides();
  }
  Tensor(Shape shape, std::vector<T> data) : shape_(std::move(shape)), data_(std::move(data)) {
    if (checked_numel(shape_, "Tensor") != static_cast<std::int64_t>(data_.size()))
      throw InvalidArgument("Tensor: data has " + std::to_string(data_.size()) + " elements, shape " +
                            shape_to_string(shape_) + " needs " + std::to_string(checked_numel(shape_, "Tensor")));
    compute_strides();
  }

  const Shape& shape() const { return shape_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t rank() const { return shape_.size(); }
  std::int64_t numel() const { return static_cast<std::int64_t>(data_.size()); }
  bool empty() const { return data_.empty(); }

  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  std::vector<T>& values() { return data_; }
  const std::vector<T>& values() const { return data_; }

  template <class... I>
  T& operator()(I... idx) {
    return data_[offset(idx...)];
  }
  template <class... I>
  const T& operator()(I... idx) const {
    return data_[offset(idx...)];
  }

  // Row-major offset of a multi-index; rank is checked, bounds are the caller's contract.
  template <class... I>
  std::size_t offset(I... idx) const {
    const std::int64_t ix[] = {static_cast<std::int64_t>(idx)...};
    std::int64_t off = 0;
    for (std::size_t d = 0; d < sizeof...(I); ++d) off += ix[d] * strides_[d];
    return static_cast<std::size_t>(off);
  }

  // Elementwise conversion to another scalar tier (double -> rational is exact).
  template <class U, class Convert>
  Tensor<U> map(Convert&& convert) const {
    std::vector<U> out;
    out.reserve(data_.size());
    for (const T& x : data_) out.push_back(convert(x));
    return Tensor<U>(shape_, std::move(out));
  }
  template <class U>
  Tensor<U> cast() const {
    return map<U>([](const T& x) { return static_cast<U>(x); });
  }

  friend bool operator==(const Tensor& a, const Tensor& b) { return a.shape_ == b.shape_ && a.data_ == b.data_; }

 private:
  void compute_strides() {
    strides_.assign(shape_.size(), 1);
    for (std::size_t d = shape_.size(); d-- > 1;) strides_[d - 1] = strides_[d] * shape_[d];
  }

  Shape shape_;
  std::vector<std::int64_t> strides_;
  std::vector<T> data_;
};

}  // namespace k3ref
