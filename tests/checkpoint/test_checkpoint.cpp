// Checkpoint folders: save/load round trip with metadata and RNG state,
// loading under another layout from the union of the files, refusal of
// missing/wrong/corrupt tensors with tensor and file named, atomicity rules
// for discovery (.tmp- folders, incomplete folders) and pruning.
#include "checkpoint/checkpoint.h"
#include "checkpoint/manager.h"
#include "core/rng.h"
#include "test_util.h"

namespace viaduct::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::bitwise_equal;
using testing::expect_file_error;
using testing::flip_byte;
using Checkpoints = testing::ScratchDir;

// A tiny "model": 4 layers with a bf16 and an fp32 weight each, plus optimizer
// state for the fp32 weights.
NamedTensors make_model(int64_t seed) {
  torch::manual_seed(seed);
  NamedTensors t;
  t.emplace_back("tok_embeddings.weight", torch::randn({16, 8}));
  for (int i = 0; i < 4; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    t.emplace_back(p + "attention.wq.weight", torch::randn({8, 8}));
    t.emplace_back(p + "attention_norm.weight",
                   torch::randn({8}).to(at::kBFloat16));
  }
  t.emplace_back("lm_head.weight", torch::randn({16, 8}));
  return t;
}

NamedTensors make_optim(const NamedTensors& model) {
  NamedTensors t;
  for (const auto& [fqn, w] : model) {
    t.emplace_back(optim_state_fqn("exp_avg", fqn), w.to(at::kFloat) * 0.5);
    t.emplace_back(optim_state_fqn("exp_avg_sq", fqn), w.to(at::kFloat).square());
  }
  return t;
}

NamedTensors zeros_like(const NamedTensors& ts) {
  NamedTensors out;
  for (const auto& [n, t] : ts) out.emplace_back(n, torch::zeros_like(t));
  return out;
}

NamedTensors subset(const NamedTensors& ts, size_t rank, size_t world) {
  NamedTensors out;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (i * world / ts.size() == rank) out.push_back(ts[i]);
  }
  return out;
}

CheckpointMetadata make_meta(int64_t step) {
  CheckpointMetadata m;
  m.step = step;
  m.tokens_seen = step * 4096;
  m.data_cursor = {{"epoch", 1}, {"position", 12345}};
  m.config_toml = "[training]\nsteps = 100\n";
  m.layout = {{"pp", 1}, {"dp", 1}};
  return m;
}

fs::path save_simple(const fs::path& folder, int64_t step, int64_t seed = 1) {
  auto model = make_model(seed);
  return save_checkpoint(folder, make_meta(step),
                         {{"model.safetensors", model, {}},
                          {"optim.safetensors", make_optim(model), {}}});
}

TEST_F(Checkpoints, SaveLoadRoundTripWithMetadataAndRng) {
  auto model = make_model(3);
  auto optim = make_optim(model);
  CheckpointMetadata meta = make_meta(20);
  at::Generator gen = make_generator(42, "dropout");
  at::randn({10}, gen);  // advance it
  meta.rng_states["cpu"] = generator_state_hex(gen);
  const at::Tensor reference_draw = at::randn({10}, gen);
  meta.extra = {{"lr_scheduler_step", 20}};

  const fs::path dir = save_checkpoint(
      dir_, meta,
      {{"model.safetensors", model, {{"kind", "model"}}},
       {"optim.safetensors", optim, {}}});
  EXPECT_EQ(dir, checkpoint_dir(dir_, 20));
  EXPECT_TRUE(fs::exists(dir / kMetadataFileName));
  for (const auto& de : fs::directory_iterator(dir_)) {
    EXPECT_EQ(de.path().filename(), "step-20") << "no tmp folder left behind";
  }
  for (const auto& de : fs::directory_iterator(dir)) {
    EXPECT_EQ(de.path().string().find(kPartRecordSuffix), std::string::npos);
  }
  ASSERT_EQ(find_latest_checkpoint(dir_), 20);
  ASSERT_EQ(find_latest_checkpoint(dir_, Verify::kChecksums), 20);

  Checkpoint ckpt = open_checkpoint(dir);
  EXPECT_EQ(ckpt.metadata.step, 20);
  EXPECT_EQ(ckpt.metadata.tokens_seen, 20 * 4096);
  EXPECT_EQ(ckpt.metadata.data_cursor, meta.data_cursor);
  EXPECT_EQ(ckpt.metadata.config_toml, meta.config_toml);
  EXPECT_EQ(ckpt.metadata.layout, meta.layout);
  EXPECT_EQ(ckpt.metadata.extra, meta.extra);
  EXPECT_EQ(ckpt.metadata.format_version, kCheckpointFormatVersion);
  ASSERT_EQ(ckpt.metadata.files.size(), 2u);
  EXPECT_EQ(ckpt.metadata.files[0].name, "model.safetensors");
  EXPECT_EQ(ckpt.metadata.files[0].bytes,
            fs::file_size(dir / "model.safetensors"));

  auto model_back = zeros_like(model);
  auto optim_back = zeros_like(optim);
  auto report = ckpt.tensors.load_into(model_back);
  EXPECT_EQ(report.loaded.size(), model.size());
  ckpt.tensors.load_into(optim_back);
  for (size_t i = 0; i < model.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model_back[i].second, model[i].second))
        << model[i].first;
    EXPECT_TRUE(torch::equal(model_back[i].second, model[i].second));
  }
  for (size_t i = 0; i < optim.size(); ++i) {
    EXPECT_TRUE(torch::equal(optim_back[i].second, optim[i].second))
        << optim[i].first;
  }
  EXPECT_TRUE(ckpt.tensors.contains("optim.exp_avg.layers.3.attention.wq.weight"));

  at::Generator restored = make_generator(0, "other");
  set_generator_state(restored, ckpt.metadata.rng_states.at("cpu"));
  EXPECT_TRUE(torch::equal(at::randn({10}, restored), reference_draw));

  // The metadata JSON round-trips.
  auto again = CheckpointMetadata::from_json(ckpt.metadata.to_json(), "x");
  EXPECT_EQ(again.to_json(), ckpt.metadata.to_json());
}

TEST_F(Checkpoints, TwoPhaseSaveFromRanksLoadsUnderAnotherLayout) {
  auto model = make_model(5);
  auto optim = make_optim(model);
  // Save as 2 ranks, each writing its half into the shared tmp folder.
  const fs::path tmp = checkpoint_tmp_dir(dir_, 7, "job1");
  std::vector<std::string> reference;
  for (int r = 0; r < 2; ++r) {
    CheckpointPart mp{part_file_name("model", r, 2), subset(model, r, 2), {}};
    CheckpointPart op{part_file_name("optim", r, 2), subset(optim, r, 2), {}};
    write_checkpoint_part(tmp, mp);
    write_checkpoint_part(tmp, op);
    reference.push_back(mp.file_name);
    reference.push_back(op.file_name);
  }
  EXPECT_FALSE(find_latest_checkpoint(dir_).has_value()) << "not committed yet";
  CheckpointMetadata meta = make_meta(7);
  meta.layout = {{"pp", 2}};
  commit_checkpoint(dir_, tmp, meta, reference);
  EXPECT_FALSE(fs::exists(tmp));
  ASSERT_EQ(find_latest_checkpoint(dir_), 7);

  Checkpoint ckpt = open_checkpoint(checkpoint_dir(dir_, 7));
  EXPECT_EQ(ckpt.tensors.files().size(), 4u);
  EXPECT_TRUE(fs::exists(checkpoint_dir(dir_, 7) / "model-rank1.safetensors"));
  // Load as 3 ranks: each takes its own third, by FQN, across both files.
  for (size_t r = 0; r < 3; ++r) {
    auto mine = subset(model, r, 3);
    auto dst = zeros_like(mine);
    ckpt.tensors.load_into(dst);
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(dst[i].second, mine[i].second)) << mine[i].first;
    }
  }
  // And as one process, straight from the folder's union of files.
  TensorFileIndex index(checkpoint_dir(dir_, 7));
  EXPECT_EQ(index.names().size(), model.size() + optim.size());
  auto loaded = index.load_many({"layers.0.attention.wq.weight", "lm_head.weight"});
  EXPECT_TRUE(torch::equal(loaded.at("lm_head.weight"), model.back().second));
  auto one_shot = load_tensors(checkpoint_dir(dir_, 7), {"lm_head.weight"});
  EXPECT_TRUE(torch::equal(one_shot.at("lm_head.weight"), model.back().second));
  EXPECT_NE(index.file_of("lm_head.weight").path().filename(),
            index.file_of("tok_embeddings.weight").path().filename());
}

TEST_F(Checkpoints, UnionOfTwoFilesLoadsByFqn) {
  auto model = make_model(9);
  make_dirs(dir_ / "u");
  write_safetensors(dir_ / "u" / "a.safetensors", subset(model, 0, 2));
  write_safetensors(dir_ / "u" / "b.safetensors", subset(model, 1, 2));
  TensorFileIndex index(dir_ / "u");
  auto dst = zeros_like(model);
  index.load_into(dst);
  for (size_t i = 0; i < model.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(dst[i].second, model[i].second)) << model[i].first;
  }
  EXPECT_EQ(index.file_of(model.front().first).path().filename(), "a.safetensors");
  EXPECT_EQ(index.file_of(model.back().first).path().filename(), "b.safetensors");
}

// See Note [Tensors stored in pieces]: the elements of a tensor split at
// `cuts` into pieces, written into one file per piece.
void write_pieces(const fs::path& dir, const std::string& fqn, const at::Tensor& whole,
                  const std::vector<int64_t>& cuts) {
  make_dirs(dir);
  const auto flat = whole.reshape(-1);
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    auto [tensors, meta] = piece_entries(
        {{fqn, whole.sizes().vec(), cuts[i], flat.slice(0, cuts[i], cuts[i + 1])}});
    write_safetensors(dir / ("p" + std::to_string(i) + ".safetensors"), tensors, meta);
  }
}

TEST_F(Checkpoints, PiecesInSeveralFilesLoadAsTheWholeTensor) {
  torch::manual_seed(3);
  const auto whole = torch::randn({6, 10});
  write_pieces(dir_ / "p", "optim.exp_avg.w", whole, {0, 17, 18, 60});
  TensorFileIndex index(dir_ / "p");
  EXPECT_EQ(index.names(), std::vector<std::string>{"optim.exp_avg.w"});
  EXPECT_TRUE(index.contains("optim.exp_avg.w"));
  const auto info = index.info("optim.exp_avg.w");
  EXPECT_EQ(info.shape, (std::vector<int64_t>{6, 10}));
  EXPECT_EQ(info.pieces, 3u);
  EXPECT_TRUE(bitwise_equal(index.load("optim.exp_avg.w"), whole));
  NamedTensors dst = {{"optim.exp_avg.w", torch::zeros({6, 10})}};
  index.load_into(dst);
  EXPECT_TRUE(bitwise_equal(dst[0].second, whole));
  NamedTensors wrong = {{"optim.exp_avg.w", torch::zeros({10, 6})}};
  expect_file_error([&] { index.load_into(wrong); }, {"optim.exp_avg.w", "[6, 10]", "[10, 6]"});
  expect_file_error([&] { index.entry("optim.exp_avg.w"); }, {"optim.exp_avg.w", "pieces"});
}

TEST_F(Checkpoints, PiecesWithAGapOrTwiceAreRefused) {
  const auto whole = torch::arange(40, at::kFloat).reshape({4, 10});
  // Elements [10, 20) are in no file: a missing rank's slice.
  write_pieces(dir_ / "gap", "m", whole, {0, 10});
  {
    auto [t, meta] = piece_entries({{"m", {4, 10}, 20, whole.reshape(-1).slice(0, 20, 40)}});
    write_safetensors(dir_ / "gap" / "q.safetensors", t, meta);
  }
  TensorFileIndex gap(dir_ / "gap");
  expect_file_error([&] { gap.load("m"); }, {"'m'", "[10, 20)", "no piece"});
  // The tail missing.
  write_pieces(dir_ / "tail", "m", whole, {0, 30});
  expect_file_error([&] { TensorFileIndex(dir_ / "tail").load("m"); }, {"'m'", "[30, 40)"});
  // Two pieces at one offset, in two files.
  write_pieces(dir_ / "twice", "m", whole, {0, 40});
  fs::copy_file(dir_ / "twice" / "p0.safetensors", dir_ / "twice" / "p1.safetensors");
  expect_file_error([&] { TensorFileIndex index(dir_ / "twice"); },
                    {"'m'", "two pieces", "p0.safetensors", "p1.safetensors"});
  // A piece that does not fit the shape it claims.
  make_dirs(dir_ / "big");
  {
    auto [t, meta] = piece_entries({{"m", {2, 10}, 15, whole.reshape(-1).slice(0, 0, 10)}});
    write_safetensors(dir_ / "big" / "a.safetensors", t, meta);
  }
  expect_file_error([&] { TensorFileIndex index(dir_ / "big"); }, {"m@15", "[15, 25)", "[2, 10]"});
  // Whole and in pieces at once.
  write_pieces(dir_ / "both", "m", whole, {0, 40});
  write_safetensors(dir_ / "both" / "w.safetensors", {{"m", whole}});
  expect_file_error([&] { TensorFileIndex index(dir_ / "both"); }, {"'m'", "whole and in pieces"});
}

TEST_F(Checkpoints, DamagedPieceIsNamed) {
  const auto whole = torch::arange(64, at::kFloat);
  write_pieces(dir_ / "d", "m", whole, {0, 32, 64});
  const auto file = dir_ / "d" / "p1.safetensors";
  flip_byte(file, fs::file_size(file) - 4);
  TensorFileIndex index(dir_ / "d");
  expect_file_error([&] { index.load("m"); }, {"m@32", "p1.safetensors"});
}

// A rank that keeps a slice of a tensor reads the slice: load_range and
// load_rows against the whole tensor's flattening, over pieces (ranges inside
// one piece, across several, empty, the whole) and over a tensor stored
// whole (fp32 and bf16, checksums on and off).
TEST_F(Checkpoints, RangesAndRowsAreTheWholeTensorsSlices) {
  torch::manual_seed(5);
  const auto whole = torch::randn({6, 10});
  write_pieces(dir_ / "r", "m", whole, {0, 17, 18, 60});
  make_dirs(dir_ / "w");
  write_safetensors(dir_ / "w" / "w.safetensors",
                    {{"m", whole}, {"h", whole.to(at::kBFloat16)}});
  const auto flat = whole.reshape(-1);
  for (const auto& [folder, name] : std::vector<std::pair<std::string, std::string>>{
           {"r", "m"}, {"w", "m"}, {"w", "h"}}) {
    SCOPED_TRACE(folder + " " + name);
    TensorFileIndex index(dir_ / folder);
    const auto ref = index.load(name).reshape(-1);
    EXPECT_TRUE(bitwise_equal(ref.to(at::kFloat), name == "h" ? flat.to(at::kBFloat16).to(at::kFloat)
                                                              : flat));
    for (const auto& [b, e] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 60}, {0, 17}, {3, 9}, {16, 19}, {17, 18}, {10, 50}, {59, 60}, {20, 20}}) {
      for (const bool verify : {true, false}) {
        const auto got = index.load_range(name, b, e, verify);
        EXPECT_EQ(got.scalar_type(), ref.scalar_type());
        EXPECT_TRUE(bitwise_equal(got, ref.slice(0, b, e))) << b << " " << e;
      }
    }
    const auto rows = index.load_rows(name, 2, 3);
    EXPECT_EQ(rows.sizes(), (at::IntArrayRef{3, 10}));
    EXPECT_TRUE(bitwise_equal(rows, index.load(name).narrow(0, 2, 3)));
    // Outside the tensor: the caller's mistake, named.
    for (const auto& [fn, part] : std::vector<std::pair<std::function<void()>, std::string>>{
             {[&] { index.load_range(name, 50, 61); }, "[50, 61) are outside its 60"},
             {[&] { index.load_rows(name, 5, 2); }, "rows [5, 7) are outside"}}) {
      try {
        fn();
        ADD_FAILURE() << part;
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    }
  }
}

// A whole entry larger than the read buffer (8 MiB): the checksum streams
// over several buffers, and a range that straddles buffers is copied whole.
TEST_F(Checkpoints, RangeOfALargeWholeTensorStraddlesReadBuffers) {
  const int64_t n = (int64_t{5} << 20) / 2;  // 10 MiB of fp32
  const auto whole = torch::arange(n, at::kInt).to(at::kFloat);
  make_dirs(dir_ / "big");
  write_safetensors(dir_ / "big" / "w.safetensors", {{"m", whole}});
  TensorFileIndex index(dir_ / "big");
  const int64_t edge = (int64_t{8} << 20) / 4;  // the first buffer's last element + 1
  for (const auto& [b, e] : std::vector<std::pair<int64_t, int64_t>>{
           {edge - 5, edge + 7}, {edge, n}, {0, edge}, {n - 1, n}}) {
    EXPECT_TRUE(bitwise_equal(index.load_range("m", b, e), whole.slice(0, b, e))) << b << " " << e;
  }
  flip_byte(dir_ / "big" / "w.safetensors", fs::file_size(dir_ / "big" / "w.safetensors") - 4);
  TensorFileIndex damaged(dir_ / "big");
  expect_file_error([&] { damaged.load_range("m", 0, 4); }, {"'m'", "checksum mismatch"});
}

// Only the pieces a range overlaps are read: damage in another piece does
// not stop it (that piece's reader finds it), damage in an overlapping piece
// does, and a whole tensor's checksum covers all of it whatever the range.
TEST_F(Checkpoints, RangeReadsOnlyItsPiecesAndChecksumsThemWhole) {
  const auto whole = torch::arange(96, at::kFloat);
  write_pieces(dir_ / "d", "m", whole, {0, 32, 64, 96});
  const auto file = dir_ / "d" / "p1.safetensors";
  flip_byte(file, fs::file_size(file) - 4);  // the last element of [32, 64)
  TensorFileIndex index(dir_ / "d");
  EXPECT_TRUE(bitwise_equal(index.load_range("m", 0, 32), whole.slice(0, 0, 32)));
  EXPECT_TRUE(bitwise_equal(index.load_range("m", 64, 96), whole.slice(0, 64, 96)));
  expect_file_error([&] { index.load_range("m", 40, 41); }, {"m@32", "p1.safetensors"});
  expect_file_error([&] { index.load_range("m", 20, 70); }, {"m@32", "checksum"});
  make_dirs(dir_ / "dw");
  write_safetensors(dir_ / "dw" / "w.safetensors", {{"m", whole}});
  flip_byte(dir_ / "dw" / "w.safetensors", fs::file_size(dir_ / "dw" / "w.safetensors") - 4);
  TensorFileIndex w(dir_ / "dw");
  expect_file_error([&] { w.load_range("m", 0, 8); }, {"'m'", "w.safetensors", "checksum"});
  EXPECT_TRUE(bitwise_equal(w.load_range("m", 0, 8, /*verify_checksum=*/false),
                            whole.slice(0, 0, 8)));
}

TEST_F(Checkpoints, SameFqnInTwoFilesIsRefused) {
  make_dirs(dir_ / "dup");
  write_safetensors(dir_ / "dup" / "a.safetensors", {{"w", torch::ones({2})}});
  write_safetensors(dir_ / "dup" / "b.safetensors", {{"w", torch::ones({2})}});
  expect_file_error([&] { TensorFileIndex index(dir_ / "dup"); },
                    {"'w'", "a.safetensors", "b.safetensors"});
}

TEST_F(Checkpoints, MissingTensorNamesTensorAndFiles) {
  const fs::path dir = save_simple(dir_, 1);
  Checkpoint ckpt = open_checkpoint(dir);
  NamedTensors dst = {{"layers.9.attention.wq.weight", torch::zeros({8, 8})}};
  expect_file_error([&] { ckpt.tensors.load_into(dst); },
                    {"layers.9.attention.wq.weight", "step-1",
                     "model.safetensors", "optim.safetensors"});
  LoadOptions lenient;
  lenient.strict = false;
  auto report = ckpt.tensors.load_into(dst, lenient);
  EXPECT_EQ(report.missing, std::vector<std::string>{"layers.9.attention.wq.weight"});
  EXPECT_TRUE(report.loaded.empty());
}

TEST_F(Checkpoints, WrongShapeNamesTensorAndFile) {
  Checkpoint ckpt = open_checkpoint(save_simple(dir_, 1));
  NamedTensors dst = {{"layers.2.attention.wq.weight", torch::zeros({8, 4})}};
  expect_file_error([&] { ckpt.tensors.load_into(dst); },
                    {"layers.2.attention.wq.weight", "model.safetensors",
                     "[8, 8]", "[8, 4]"});
}

TEST_F(Checkpoints, WrongDtypeIsRefusedUnlessCastIsAsked) {
  auto model = make_model(1);
  Checkpoint ckpt = open_checkpoint(save_simple(dir_, 1));
  const std::string fqn = "layers.1.attention_norm.weight";  // stored BF16
  NamedTensors dst = {{fqn, torch::zeros({8})}};
  expect_file_error([&] { ckpt.tensors.load_into(dst); },
                    {fqn, "model.safetensors", "BF16", "Float"});
  LoadOptions cast;
  cast.allow_dtype_cast = true;
  ckpt.tensors.load_into(dst, cast);
  EXPECT_TRUE(torch::equal(dst[0].second, model[4].second.to(at::kFloat)));
}

TEST_F(Checkpoints, NonContiguousDestinationAndModule) {
  torch::manual_seed(11);
  torch::nn::Linear saved(torch::nn::LinearOptions(6, 4));
  NamedTensors params;
  for (const auto& p : saved->named_parameters()) params.emplace_back(p.key(), p.value());
  save_checkpoint(dir_, make_meta(2), {{"model.safetensors", params, {}}});
  Checkpoint ckpt = open_checkpoint(checkpoint_dir(dir_, 2));

  torch::nn::Linear fresh(torch::nn::LinearOptions(6, 4));
  auto report = ckpt.tensors.load_into(*fresh);
  EXPECT_EQ(report.loaded.size(), 2u);
  EXPECT_TRUE(torch::equal(fresh->weight, saved->weight));
  EXPECT_TRUE(torch::equal(fresh->bias, saved->bias));
  EXPECT_TRUE(fresh->weight.requires_grad());

  at::Tensor storage = torch::zeros({6, 4});
  NamedTensors dst = {{"weight", storage.t()}};  // a non-contiguous view
  ckpt.tensors.load_into(dst);
  EXPECT_TRUE(torch::equal(storage.t(), saved->weight));
}

TEST_F(Checkpoints, ChecksumMismatchNamesFileAndTensor) {
  save_simple(dir_, 1);
  const fs::path dir = save_simple(dir_, 2);
  const fs::path file = dir / "model.safetensors";
  flip_byte(file, fs::file_size(file) - 1);  // last bytes: a bf16 tensor
  const std::string last = "layers.3.attention_norm.weight";

  expect_file_error([&] { open_checkpoint(dir); },
                    {"model.safetensors", "checksum mismatch", last});
  expect_file_error([&] { verify_checkpoint(dir); },
                    {"model.safetensors", "checksum"});
  // Sizes still match: discovery by size sees it, by checksum skips it.
  EXPECT_EQ(find_latest_checkpoint(dir_), 2);
  EXPECT_EQ(find_latest_checkpoint(dir_, Verify::kChecksums), 1);
  // A rank that opens by size alone is still stopped by the tensor's CRC.
  Checkpoint ckpt = open_checkpoint(dir, Verify::kSizes);
  NamedTensors dst = {{last, torch::zeros({8}, at::kBFloat16)}};
  expect_file_error([&] { ckpt.tensors.load_into(dst); },
                    {last, "model.safetensors", "checksum"});
  NamedTensors fine = {{"lm_head.weight", torch::zeros({16, 8})}};
  EXPECT_NO_THROW(ckpt.tensors.load_into(fine));
}

TEST_F(Checkpoints, DamagedHeaderInCheckpointIsNamed) {
  const fs::path dir = save_simple(dir_, 1);
  const fs::path file = dir / "optim.safetensors";
  const std::string bytes = testing::read_bytes(file);
  // Change the shape of one optimizer tensor inside the header: [8,8] → [8,9].
  const std::string fqn = "optim.exp_avg.layers.0.attention.wq.weight";
  size_t at = bytes.find("\"" + fqn + "\"");
  size_t shape = bytes.find("\"shape\":[8,8]", at);
  ASSERT_NE(shape, std::string::npos);
  std::string b = bytes;
  b[shape + std::strlen("\"shape\":[8,")] = '9';
  testing::write_bytes(file, b);
  expect_file_error([&] { open_checkpoint(dir); },
                    {"optim.safetensors", "checksum", fqn});
}

TEST_F(Checkpoints, TruncatedFileIsSkippedByDiscoveryAndRefusedAtLoad) {
  save_simple(dir_, 1);
  const fs::path dir = save_simple(dir_, 2);
  const fs::path file = dir / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 3);
  EXPECT_EQ(find_latest_checkpoint(dir_), 1);
  expect_file_error([&] { open_checkpoint(dir); },
                    {"model.safetensors", "truncated",
                     "layers.3.attention_norm.weight"});
}

TEST_F(Checkpoints, MissingListedFileIsIncomplete) {
  save_simple(dir_, 1);
  const fs::path dir = save_simple(dir_, 2);
  fs::remove(dir / "optim.safetensors");
  EXPECT_EQ(find_latest_checkpoint(dir_), 1);
  expect_file_error([&] { open_checkpoint(dir); }, {"optim.safetensors", "missing"});
}

TEST_F(Checkpoints, TmpAndIncompleteFoldersAreNeverLatest) {
  const fs::path done = save_simple(dir_, 10);
  // A complete-looking copy under a tmp name (a crash just before rename).
  fs::copy(done, dir_ / "step-20.tmp-999", fs::copy_options::recursive);
  fs::copy(done, dir_ / "step-5.tmp-999", fs::copy_options::recursive);
  // A step folder without metadata.json, and one with a bad metadata.json.
  fs::create_directories(dir_ / "step-30");
  fs::copy(done / "model.safetensors", dir_ / "step-30" / "model.safetensors");
  fs::copy(done, dir_ / "step-40", fs::copy_options::recursive);
  testing::write_bytes(dir_ / "step-40" / kMetadataFileName, "{\"format\": ");
  // A step folder whose metadata says another step.
  fs::copy(done, dir_ / "step-50", fs::copy_options::recursive);
  fs::create_directories(dir_ / "step-abc");

  EXPECT_EQ(find_latest_checkpoint(dir_), 10);
  EXPECT_EQ(list_checkpoints(dir_), std::vector<int64_t>{10});
  expect_file_error([&] { load_checkpoint_metadata(dir_ / "step-30"); },
                    {"step-30", "metadata.json"});
  expect_file_error([&] { load_checkpoint_metadata(dir_ / "step-40"); },
                    {"step-40", "metadata.json"});

  // The next save removes stale tmp folders of its step or earlier.
  save_simple(dir_, 11);
  EXPECT_FALSE(fs::exists(dir_ / "step-5.tmp-999"));
  EXPECT_TRUE(fs::exists(dir_ / "step-20.tmp-999"));
  EXPECT_EQ(find_latest_checkpoint(dir_), 11);
  EXPECT_FALSE(find_latest_checkpoint(dir_ / "nowhere").has_value());
}

TEST_F(Checkpoints, CommitRefusesAMissingRankPart) {
  auto model = make_model(1);
  const fs::path tmp = checkpoint_tmp_dir(dir_, 3, "job");
  write_checkpoint_part(tmp, {part_file_name("model", 0, 2), subset(model, 0, 2), {}});
  expect_file_error(
      [&] {
        commit_checkpoint(dir_, tmp, make_meta(3),
                          {"model-rank0.safetensors", "model-rank1.safetensors"});
      },
      {"model-rank1.safetensors", "missing"});
  // A part without its record (its writer died mid-write) is refused too.
  testing::write_bytes(tmp / "model-rank1.safetensors", "partial");
  expect_file_error([&] { commit_checkpoint(dir_, tmp, make_meta(3)); },
                    {"model-rank1.safetensors", "did not finish"});
  EXPECT_FALSE(find_latest_checkpoint(dir_).has_value());
}

TEST_F(Checkpoints, PruneKeepsTheNewest) {
  for (int64_t s : {1, 2, 3, 4, 5}) save_simple(dir_, s * 10);
  EXPECT_TRUE(prune_checkpoints(dir_, 0).empty());
  EXPECT_EQ(list_checkpoints(dir_).size(), 5u);
  EXPECT_EQ(prune_checkpoints(dir_, 2), (std::vector<int64_t>{10, 20, 30}));
  EXPECT_EQ(list_checkpoints(dir_), (std::vector<int64_t>{40, 50}));
  std::vector<std::string> left;
  for (const auto& de : fs::directory_iterator(dir_)) {
    left.push_back(de.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-40", "step-50"}));
  EXPECT_TRUE(prune_checkpoints(dir_, 2).empty());
  EXPECT_EQ(prune_checkpoints(dir_, 1), std::vector<int64_t>{40});
}

TEST_F(Checkpoints, SavingAnExistingStepReplacesIt) {
  save_simple(dir_, 3, /*seed=*/1);
  save_simple(dir_, 3, /*seed=*/2);
  auto reference = make_model(2);
  Checkpoint ckpt = open_checkpoint(checkpoint_dir(dir_, 3));
  auto dst = zeros_like(reference);
  ckpt.tensors.load_into(dst);
  EXPECT_TRUE(torch::equal(dst[0].second, reference[0].second));
  EXPECT_EQ(list_checkpoints(dir_), std::vector<int64_t>{3});
  for (const auto& de : fs::directory_iterator(dir_)) {
    EXPECT_EQ(de.path().filename(), "step-3");
  }
}

TEST_F(Checkpoints, MetadataFromNewerFormatIsRefused) {
  const fs::path dir = save_simple(dir_, 1);
  auto j = load_checkpoint_metadata(dir).to_json();
  j["format_version"] = 99;
  testing::write_bytes(dir / kMetadataFileName, j.dump());
  expect_file_error([&] { load_checkpoint_metadata(dir); },
                    {"metadata.json", "format version 99"});
  j["format_version"] = kCheckpointFormatVersion;
  j.erase("step");
  testing::write_bytes(dir / kMetadataFileName, j.dump());
  expect_file_error([&] { load_checkpoint_metadata(dir); }, {"'step'"});
}

TEST_F(Checkpoints, CudaTensorsSaveAndLoadToTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto model = make_model(4);
  NamedTensors on_gpu;
  for (const auto& [n, t] : model) on_gpu.emplace_back(n, t.to(at::kCUDA));
  save_checkpoint(dir_, make_meta(1), {{"model.safetensors", on_gpu, {}}});
  Checkpoint ckpt = open_checkpoint(checkpoint_dir(dir_, 1));
  NamedTensors dst;
  for (const auto& [n, t] : on_gpu) dst.emplace_back(n, torch::zeros_like(t));
  ckpt.tensors.load_into(dst);
  for (size_t i = 0; i < model.size(); ++i) {
    EXPECT_TRUE(dst[i].second.is_cuda());
    EXPECT_TRUE(bitwise_equal(dst[i].second, model[i].second)) << model[i].first;
  }
}

TEST(CheckpointNames, FilesAndFolders) {
  EXPECT_EQ(part_file_name("model", 0, 1), "model.safetensors");
  EXPECT_EQ(part_file_name("optim", 3, 4), "optim-rank3.safetensors");
  EXPECT_EQ(part_file_name("optim", 3, 4, 1, 1), "optim-rank3.safetensors");
  EXPECT_EQ(part_file_name("optim", 3, 4, 1, 2), "optim-rank3-dp1.safetensors");
  EXPECT_EQ(part_file_name("optim", 0, 1, 2, 4), "optim-dp2.safetensors");
  EXPECT_EQ(checkpoint_dir("/x", 12), fs::path("/x/step-12"));
  EXPECT_EQ(checkpoint_tmp_dir("/x", 12, "77"), fs::path("/x/step-12.tmp-77"));
  EXPECT_EQ(optim_state_fqn("exp_avg", "layers.3.attention.wq.weight"),
            "optim.exp_avg.layers.3.attention.wq.weight");
  std::vector<uint8_t> bytes = {0, 1, 0xab, 0xff};
  EXPECT_EQ(bytes_to_hex(bytes.data(), bytes.size()), "0001abff");
  EXPECT_EQ(hex_to_bytes("0001abff", "t"), bytes);
  EXPECT_THROW(hex_to_bytes("0g", "t"), FileError);
}

}  // namespace
}  // namespace viaduct::checkpoint
