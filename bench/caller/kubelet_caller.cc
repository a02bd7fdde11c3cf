// The kubelet's side of bench/bench_prepare.py: a compiled gRPC client, as the kubelet is, that
// calls the plugin over its Unix socket and times each call. Measured with a Python gRPC client
// instead, every prepare would also carry that client's own work (about 0.3 ms of CPU per call
// on a small node), which no kubelet spends.
//
// Requests and answers are opaque bytes: the bench encodes them and checks every answer with
// the generated Python messages. Commands on stdin, answers on stdout:
//   call <method> <n>\n<n bytes>
//       -> <nanoseconds>\n<grpc status code> <m>\n<m bytes: the answer, or the error message>
//   parallel <threads> <count>\n then <count> times: <method> <n>\n<n bytes>
//       -> <nanoseconds for all>\n then <count> times: <grpc status code> <m>\n<m bytes>
// All calls share one channel (one connection), as the kubelet's calls to one plugin do.
// Build: hack/build-bench-caller.sh (g++ and libgrpc++-dev).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <iostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  int code;
  std::string body;
};

// One unary call, waited for on `cq` (one completion queue per calling thread).
Result Call(grpc::GenericStub& stub, grpc::CompletionQueue& cq, const std::string& method,
            const std::string& request) {
  grpc::Slice slice(request);
  grpc::ByteBuffer in(&slice, 1);
  grpc::ByteBuffer out;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status status;
  auto rpc = stub.PrepareUnaryCall(&context, method, in, &cq);
  rpc->StartCall();
  rpc->Finish(&out, &status, &status);
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok || tag != &status) {
    return {grpc::StatusCode::INTERNAL, "the completion queue failed"};
  }
  if (!status.ok()) return {status.error_code(), status.error_message()};
  std::vector<grpc::Slice> slices;
  if (!out.Dump(&slices).ok()) return {grpc::StatusCode::INTERNAL, "cannot read the answer"};
  std::string body;
  for (const auto& s : slices) body.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return {grpc::StatusCode::OK, std::move(body)};
}

bool ReadRequest(std::string& method, std::string& body) {
  std::size_t size = 0;
  if (!(std::cin >> method >> size) || std::cin.get() != '\n') return false;
  body.assign(size, '\0');
  return size == 0 || static_cast<bool>(std::cin.read(body.data(), size));
}

void WriteResult(const Result& result) {
  std::cout << result.code << ' ' << result.body.size() << '\n';
  std::cout.write(result.body.data(), static_cast<std::streamsize>(result.body.size()));
}

long long Nanoseconds(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count();
}

void Drain(grpc::CompletionQueue& cq) {
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: dra-kubelet-caller <path of the plugin's dra.sock>\n";
    return 2;
  }
  std::ios::sync_with_stdio(false);
  auto channel =
      grpc::CreateChannel(std::string("unix:") + argv[1], grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  std::string command;
  while (std::cin >> command) {
    if (command == "call") {
      std::string method, request;
      if (!ReadRequest(method, request)) break;
      const auto start = Clock::now();
      const Result result = Call(stub, cq, method, request);
      const long long elapsed = Nanoseconds(start);
      std::cout << elapsed << '\n';
      WriteResult(result);
    } else if (command == "parallel") {
      std::size_t threads = 0, count = 0;
      if (!(std::cin >> threads >> count) || threads == 0) break;
      std::vector<std::pair<std::string, std::string>> requests(count);
      for (auto& [method, request] : requests) {
        if (!ReadRequest(method, request)) return 1;
      }
      std::vector<Result> results(count);
      std::atomic<std::size_t> next{0};
      std::atomic<bool> go{false};
      std::vector<std::thread> pool;
      for (std::size_t t = 0; t < threads; ++t) {
        pool.emplace_back([&] {
          grpc::CompletionQueue own;
          while (!go.load()) std::this_thread::yield();
          for (std::size_t i = next++; i < count; i = next++) {
            results[i] = Call(stub, own, requests[i].first, requests[i].second);
          }
          Drain(own);
        });
      }
      const auto start = Clock::now();
      go.store(true);
      for (auto& thread : pool) thread.join();
      std::cout << Nanoseconds(start) << '\n';
      for (const auto& result : results) WriteResult(result);
    } else {
      std::cerr << "dra-kubelet-caller: unknown command " << command << '\n';
      return 2;
    }
    std::cout.flush();
  }
  Drain(cq);
  return 0;
}
