#include "coordinator/catalog.h"

#include <cstdlib>
#include <filesystem>
#include <string>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;

class CatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_catalog_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    Reopen();
  }
  void TearDown() override {
    catalog_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Reopen() {
    catalog_.reset();
    CatalogOptions options;
    options.path = dir_;
    options.sync_writes = false;
    auto c = Catalog::Open(options);
    ASSERT_TRUE(c.ok()) << c.status();
    catalog_ = *std::move(c);
  }
  static v1::DocumentRecord Doc(const std::string& id) {
    v1::DocumentRecord r;
    r.mutable_info()->set_document_id(id);
    r.mutable_info()->set_state(v1::DocumentInfo::PENDING);
    return r;
  }
  static v1::JobRecord Job(const std::string& id) {
    v1::JobRecord r;
    r.mutable_info()->set_job_id(id);
    r.mutable_info()->set_state(v1::JobInfo::QUEUED);
    return r;
  }

  std::string dir_;
  std::unique_ptr<Catalog> catalog_;
};

TEST_F(CatalogTest, DocumentRoundTripSurvivesReopen) {
  v1::DocumentRecord doc = Doc("d1");
  doc.mutable_info()->set_num_tokens(3);
  const std::vector<int32_t> tokens = {1, -2, 0x7fffffff};
  STRATA_ASSERT_OK(catalog_->CreateDocument(&doc, tokens));
  EXPECT_EQ(doc.generation(), 1u);
  Reopen();
  STRATA_ASSERT_OK_AND_ASSIGN(auto got, catalog_->GetDocument("d1"));
  EXPECT_EQ(got.info().num_tokens(), 3u);
  EXPECT_EQ(got.schema_version(), kCatalogSchemaVersion);
  STRATA_ASSERT_OK_AND_ASSIGN(auto got_tokens, catalog_->GetDocumentTokens("d1"));
  EXPECT_EQ(got_tokens, tokens);
}

TEST_F(CatalogTest, CreateTwiceIsAlreadyExists) {
  v1::DocumentRecord doc = Doc("d1");
  STRATA_ASSERT_OK(catalog_->CreateDocument(&doc, {}));
  v1::DocumentRecord again = Doc("d1");
  EXPECT_THAT(catalog_->CreateDocument(&again, {}), StatusIs(absl::StatusCode::kAlreadyExists));
}

TEST_F(CatalogTest, UpdateIsCompareAndSet) {
  v1::DocumentRecord doc = Doc("d1");
  STRATA_ASSERT_OK(catalog_->CreateDocument(&doc, {}));
  v1::DocumentRecord stale = doc;
  doc.mutable_info()->set_state(v1::DocumentInfo::READY);
  STRATA_ASSERT_OK(catalog_->UpdateDocument(&doc));
  EXPECT_EQ(doc.generation(), 2u);
  stale.mutable_info()->set_state(v1::DocumentInfo::FAILED);
  EXPECT_THAT(catalog_->UpdateDocument(&stale), StatusIs(absl::StatusCode::kAborted));
  STRATA_ASSERT_OK_AND_ASSIGN(auto got, catalog_->GetDocument("d1"));
  EXPECT_EQ(got.info().state(), v1::DocumentInfo::READY);
  v1::DocumentRecord missing = Doc("nope");
  missing.set_generation(1);
  EXPECT_THAT(catalog_->UpdateDocument(&missing), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CatalogTest, ListIsOrderedAndPaged) {
  for (const char* id : {"c", "a", "b", "d"}) {
    v1::DocumentRecord doc = Doc(id);
    STRATA_ASSERT_OK(catalog_->CreateDocument(&doc, {}));
  }
  STRATA_ASSERT_OK_AND_ASSIGN(auto page1, catalog_->ListDocuments("", 3));
  ASSERT_EQ(page1.size(), 3u);
  EXPECT_EQ(page1[0].info().document_id(), "a");
  EXPECT_EQ(page1[2].info().document_id(), "c");
  STRATA_ASSERT_OK_AND_ASSIGN(auto page2, catalog_->ListDocuments("c", 3));
  ASSERT_EQ(page2.size(), 1u);
  EXPECT_EQ(page2[0].info().document_id(), "d");
}

TEST_F(CatalogTest, DeleteRemovesDocumentTokensAndShards) {
  v1::DocumentRecord doc = Doc("d1");
  STRATA_ASSERT_OK(catalog_->CreateDocument(&doc, std::vector<int32_t>{1, 2}));
  v1::ShardMapRecord shards;
  shards.mutable_map()->set_document_id("d1");
  STRATA_ASSERT_OK(catalog_->PutShardMap(&shards));
  STRATA_ASSERT_OK(catalog_->DeleteDocument("d1"));
  EXPECT_THAT(catalog_->GetDocument("d1"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(catalog_->GetDocumentTokens("d1"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(catalog_->GetShardMap("d1"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(catalog_->DeleteDocument("d1"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CatalogTest, JobsAndShardMapsAreVersioned) {
  v1::JobRecord job = Job("job-1");
  STRATA_ASSERT_OK(catalog_->CreateJob(&job));
  job.mutable_info()->set_state(v1::JobInfo::CANCELLED);
  STRATA_ASSERT_OK(catalog_->UpdateJob(&job));
  Reopen();
  STRATA_ASSERT_OK_AND_ASSIGN(auto got, catalog_->GetJob("job-1"));
  EXPECT_EQ(got.info().state(), v1::JobInfo::CANCELLED);
  EXPECT_EQ(got.generation(), 2u);
  STRATA_ASSERT_OK_AND_ASSIGN(auto jobs, catalog_->ListJobs("", 10));
  EXPECT_EQ(jobs.size(), 1u);

  v1::ShardMapRecord shards;
  shards.mutable_map()->set_document_id("d1");
  STRATA_ASSERT_OK(catalog_->PutShardMap(&shards));
  v1::ShardMapRecord again;
  again.mutable_map()->set_document_id("d1");
  EXPECT_THAT(catalog_->PutShardMap(&again), StatusIs(absl::StatusCode::kAlreadyExists));
  STRATA_ASSERT_OK(catalog_->PutShardMap(&shards));  // generation 1 -> 2
  EXPECT_EQ(shards.generation(), 2u);
}

TEST_F(CatalogTest, CountersPersist) {
  STRATA_ASSERT_OK_AND_ASSIGN(uint64_t a, catalog_->NextSequence("admission"));
  STRATA_ASSERT_OK_AND_ASSIGN(uint64_t b, catalog_->NextSequence("admission"));
  Reopen();
  STRATA_ASSERT_OK_AND_ASSIGN(uint64_t c, catalog_->NextSequence("admission"));
  EXPECT_EQ(a, 1u);
  EXPECT_EQ(b, 2u);
  EXPECT_EQ(c, 3u);
}

TEST_F(CatalogTest, SecondOpenOfSameDirectoryFails) {
  CatalogOptions options;
  options.path = dir_;
  auto second = Catalog::Open(options);
  EXPECT_FALSE(second.ok());
}

TEST(CatalogOptionsTest, EmptyPathIsInvalid) {
  EXPECT_THAT(Catalog::Open(CatalogOptions()), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::coordinator
