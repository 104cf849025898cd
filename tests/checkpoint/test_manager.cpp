// The checkpoint manager against hand-built folders: discovery with gaps,
// `.tmp-` and incomplete folders; the resume choice (newest complete, a
// damaged newest refused); the save policy; pruning to keep_latest_k; stale
// tmp folders removed up to the saved step only.
#include "checkpoint/manager.h"
#include "core/file_io.h"
#include "test_util.h"

namespace viaduct::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::expect_file_error;
using Manager = testing::ScratchDir;

CheckpointMetadata meta_at(int64_t step) {
  CheckpointMetadata m;
  m.step = step;
  m.tokens_seen = step * 100;
  return m;
}

std::vector<CheckpointPart> one_part(int64_t step) {
  return {{"model.safetensors",
           {{"w", torch::full({4}, static_cast<float>(step))}},
           {}}};
}

CheckpointPolicy policy(int64_t interval, int keep, bool save_final = true) {
  CheckpointPolicy p;
  p.enable = true;
  p.interval = interval;
  p.keep_latest_k = keep;
  p.save_final = save_final;
  return p;
}

TEST_F(Manager, DiscoveryWithGapsSkipsTmpAndIncompleteFolders) {
  for (int64_t s : {2, 5, 11}) save_checkpoint(dir_, meta_at(s), one_part(s));
  fs::create_directories(dir_ / "step-20.tmp-77");  // a crashed save
  fs::create_directories(dir_ / "step-7");           // no metadata.json
  fs::create_directories(dir_ / "step-x");           // not a step
  fs::create_directories(dir_ / "other");
  EXPECT_EQ(list_checkpoints(dir_), (std::vector<int64_t>{2, 5, 11}));
  EXPECT_EQ(find_latest_checkpoint(dir_), 11);
  EXPECT_EQ(newest_step_folder(dir_), 11);
  fs::create_directories(dir_ / "step-30");
  EXPECT_EQ(newest_step_folder(dir_), 30);
  EXPECT_EQ(find_latest_checkpoint(dir_), 11);
  EXPECT_FALSE(newest_step_folder(dir_ / "missing").has_value());
}

TEST_F(Manager, ResumeChoosesTheNewestCompleteCheckpoint) {
  CheckpointManager m(dir_, policy(1, 0));
  EXPECT_FALSE(m.resume_step().has_value()) << "empty folder";
  EXPECT_FALSE(CheckpointManager(dir_ / "missing", policy(1, 0)).resume_step().has_value());
  for (int64_t s : {3, 6}) m.save(meta_at(s), one_part(s));
  fs::create_directories(dir_ / "step-9.tmp-1");  // never a resume candidate
  ASSERT_EQ(m.resume_step(), 6);
  const auto c = m.open(6);
  EXPECT_EQ(c.metadata.step, 6);
  EXPECT_EQ(c.metadata.tokens_seen, 600);
  EXPECT_TRUE(torch::equal(c.tensors.load("w"), torch::full({4}, 6.0f)));
}

TEST_F(Manager, DamagedNewestCheckpointIsRefusedNotSkipped) {
  CheckpointManager m(dir_, policy(1, 0));
  for (int64_t s : {3, 6}) m.save(meta_at(s), one_part(s));
  const auto file = checkpoint_dir(dir_, 6) / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 1);
  expect_file_error([&] { m.resume_step(); }, {"model.safetensors"});
  // An incomplete newest folder (no metadata) is refused too, naming it.
  viaduct::remove_tree(checkpoint_dir(dir_, 6));
  fs::create_directories(checkpoint_dir(dir_, 8));
  expect_file_error([&] { m.resume_step(); }, {"step-8"});
}

TEST_F(Manager, SaveIsDueOnTheIntervalAndAtTheEnd) {
  const CheckpointManager m(dir_, policy(5, 0));
  std::vector<int64_t> due;
  for (int64_t s = 1; s <= 12; ++s)
    if (m.save_due(s, 12)) due.push_back(s);
  EXPECT_EQ(due, (std::vector<int64_t>{5, 10, 12}));
  const CheckpointManager no_final(dir_, policy(5, 0, /*save_final=*/false));
  EXPECT_FALSE(no_final.save_due(12, 12));
  EXPECT_TRUE(no_final.save_due(10, 12));
  CheckpointPolicy off = policy(5, 0);
  off.enable = false;
  EXPECT_FALSE(CheckpointManager(dir_, off).save_due(10, 12));
  EXPECT_FALSE(CheckpointManager(dir_, off).initial_save_due());
}

TEST_F(Manager, SavePrunesToKeepLatestK) {
  CheckpointManager m(dir_, policy(1, 2));
  for (int64_t s = 1; s <= 5; ++s) {
    const auto dir = m.save(meta_at(s), one_part(s));
    EXPECT_EQ(dir, checkpoint_dir(dir_, s));
  }
  EXPECT_EQ(list_checkpoints(dir_), (std::vector<int64_t>{4, 5}));
  for (const auto& de : fs::directory_iterator(dir_)) {
    EXPECT_EQ(de.path().filename().string().find(".tmp-"), std::string::npos)
        << "left behind: " << de.path();
  }
  CheckpointManager keep_all(dir_, policy(1, 0));
  keep_all.save(meta_at(6), one_part(6));
  EXPECT_EQ(list_checkpoints(dir_), (std::vector<int64_t>{4, 5, 6}));
}

TEST_F(Manager, StaleTmpFoldersAreRemovedUpToTheStep) {
  for (const char* name : {"step-1.tmp-9", "step-4.tmp-replaced-3", "step-5.tmp-1",
                           "step-9.tmp-2"}) {
    fs::create_directories(dir_ / name);
  }
  remove_stale_tmp_folders(dir_, 5);
  EXPECT_FALSE(fs::exists(dir_ / "step-1.tmp-9"));
  EXPECT_FALSE(fs::exists(dir_ / "step-4.tmp-replaced-3"));
  EXPECT_FALSE(fs::exists(dir_ / "step-5.tmp-1"));
  EXPECT_TRUE(fs::exists(dir_ / "step-9.tmp-2")) << "a later save may own it";
}

TEST_F(Manager, TwoPhaseSaveWithABarrierPerPhase) {
  // One process plays a group of one: the phases and their barriers run in
  // order, and the commit checks the expected files.
  CheckpointManager m(dir_, policy(1, 1));
  std::vector<std::string> phases;
  SaveGroup g;
  g.rank = 0;
  g.expected_files = {"model.safetensors"};
  g.barrier = [&](const std::string& what) { phases.push_back(what); };
  m.save(meta_at(4), one_part(4), &g);
  m.save(meta_at(8), one_part(8), &g);
  EXPECT_EQ(phases, (std::vector<std::string>{
                        "checkpoint step 4 (write)", "checkpoint step 4 (commit)",
                        "checkpoint prune", "checkpoint step 8 (write)",
                        "checkpoint step 8 (commit)", "checkpoint prune"}));
  EXPECT_EQ(list_checkpoints(dir_), std::vector<int64_t>{8});
  g.expected_files.push_back("optim.safetensors");
  expect_file_error([&] { m.save(meta_at(9), one_part(9), &g); }, {"optim.safetensors"});
}

}  // namespace
}  // namespace viaduct::checkpoint
