// whale consumer, a plan: replicate<M> trained for three steps on every rank
// through the installed whale::mpi or whale::core, against network<M> trained
// on the whole batch in one process (on each rank). The losses and the
// parameters must agree to rounding on every rank; run at 1 or 2 ranks.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include <whale/whale.hpp>

using namespace whale;
using model = sequential<linear<16, 32>, gelu, linear<32, 8>, softmax_cross_entropy>;

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    auto net = make<replicate<model>>(ctx, seed{42});
    network<model> single(seed{42});
    teacher_data data(seed{7}, 16, 8, 8);  // 8 samples of 16 features, 8 classes, per step
    trainer_options quiet;
    quiet.progress = false;
    trainer t(net, sgd{.lr = 0.1f, .momentum = 0.9f}, quiet);
    trainer s(single, sgd{.lr = 0.1f, .momentum = 0.9f}, quiet);
    double loss_gap = 0, first = 0, last = 0;
    for (std::int64_t k = 0; k < 3; ++k) {
      const double a = t.step(data, k), b = s.step(data, k);
      const double d = std::fabs(a - b);
      if (!(d <= loss_gap)) loss_gap = d;  // a NaN stays, and fails below
      if (k == 0) first = a;
      last = a;
    }
    const auto full = net.full_params();  // collective
    const auto mine = single.params();
    double param_gap = full.numel() == mine.numel() ? 0 : 1;
    for (index_t i = 0; i < std::min(full.numel(), mine.numel()); ++i) {
      const double d = std::fabs(static_cast<double>(full[i]) - static_cast<double>(mine[i]));
      if (!(d <= param_gap)) param_gap = d;  // a NaN stays, and fails below
    }
    const bool ok = loss_gap < 1e-5 && param_gap < 1e-5 && std::isfinite(last) && last < first;
    int bad = ok ? 0 : 1, worst = 0;
    MPI_Allreduce(&bad, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (ctx.rank() == 0)
      std::printf("whale consumer plan: replicate<mlp> on %d rank(s): loss %.5f -> %.5f, largest gap to one process: "
                  "loss %.2e, parameters %.2e: %s\n", ctx.size(), first, last, loss_gap, param_gap, worst ? "WRONG" : "ok");
    return worst;
  });
}
