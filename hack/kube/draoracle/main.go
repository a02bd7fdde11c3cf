// Command draoracle answers, for the test suite, what the kube-scheduler of this module's
// Kubernetes release would allocate and how its CEL environment judges a device selector. It is
// test tooling (built by hack/kube.sh), not part of the driver: tests/oracle.py runs it beside
// `gpu-dra explain`'s engine and requires the same answers.
//
// Input on stdin, one JSON document:
//
//	{"allocate": [{"id", "node": {"name", "labels"}, "slices", "classes", "claims", "allocated"}],
//	 "cel": [{"id", "expression", "devices": [{"driver", "allowMultipleAllocations",
//	          "attributes", "capacity"}]}]}
//
// Objects are resource.k8s.io/v1 JSON. "claims" are allocated together (one pod's claims);
// "allocated" are claims with status.allocation: the devices, shares and capacity in use.
//
// Output on stdout: {"features": ..., "allocate": [...], "cel": [...]}, one answer per case in
// input order. An allocation is what structured.Allocator.Allocate returns (one
// AllocationResult per claim), "unschedulable" the message of an ErrFailedAllocationOnNode
// error, "error" any other error (a CEL runtime error, an invalid input), and neither with no
// allocations: the claims do not fit on the node. For CEL, "validationError" is what the API
// server says of a new expression (NewExpressions environment, estimated cost limit),
// "compileError" what the scheduler's cache says (stored-expressions environment), and per
// device the selector's value or its runtime error.
//
// Both are set up as pkg/scheduler/framework/plugins/dynamicresources does: the feature set is
// AllocatorFeatures of the scheduler's feature gates at their defaults, the CEL cache is
// cel.NewCache(10, ...) with the same features, and the allocated state is GatherAllocatedState's
// (DRAConsumableCapacity on) or ListAllAllocatedDevices' (off).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apiserver/pkg/cel/environment"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	dracel "k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	schedfeature "k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"k8s.io/utils/ptr"
)

// The scheduler's Filter timeout (DRASchedulerFilterTimeout, on by default: 10 s).
const allocateTimeout = 10 * time.Second

type input struct {
	Allocate []allocateCase `json:"allocate"`
	CEL      []celCase      `json:"cel"`
}

type nodeInput struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels"`
}

type allocateCase struct {
	ID        string                       `json:"id"`
	Node      nodeInput                    `json:"node"`
	Slices    []*resourceapi.ResourceSlice `json:"slices"`
	Classes   []*resourceapi.DeviceClass   `json:"classes"`
	Claims    []*resourceapi.ResourceClaim `json:"claims"`
	Allocated []*resourceapi.ResourceClaim `json:"allocated"`
}

type allocateAnswer struct {
	ID            string                         `json:"id"`
	Allocations   []resourceapi.AllocationResult `json:"allocations"`
	Unschedulable string                         `json:"unschedulable,omitempty"`
	Error         string                         `json:"error,omitempty"`
}

type celDevice struct {
	Driver                   string                                                    `json:"driver"`
	AllowMultipleAllocations *bool                                                     `json:"allowMultipleAllocations,omitempty"`
	Attributes               map[resourceapi.QualifiedName]resourceapi.DeviceAttribute `json:"attributes"`
	Capacity                 map[resourceapi.QualifiedName]resourceapi.DeviceCapacity  `json:"capacity"`
}

type celCase struct {
	ID         string      `json:"id"`
	Expression string      `json:"expression"`
	Devices    []celDevice `json:"devices"`
}

type celResult struct {
	Value *bool  `json:"value,omitempty"`
	Error string `json:"error,omitempty"`
}

type celAnswer struct {
	ID              string      `json:"id"`
	ValidationError string      `json:"validationError,omitempty"`
	CompileError    string      `json:"compileError,omitempty"`
	Results         []celResult `json:"results"`
}

type output struct {
	Features structured.Features `json:"features"`
	Allocate []allocateAnswer    `json:"allocate"`
	CEL      []celAnswer         `json:"cel"`
}

// classLister serves the DeviceClasses of one case, as the scheduler's informer lister does.
type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, c := range l {
		out = append(out, c)
	}
	return out, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if c, ok := l[name]; ok {
		return c, nil
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "draoracle: %v\n", err)
		os.Exit(2)
	}
}

func run(in io.Reader, out io.Writer) error {
	decoder := json.NewDecoder(in)
	// A misspelt field would otherwise be dropped silently and the oracle would answer another
	// question than the test asked.
	decoder.DisallowUnknownFields()
	var doc input
	if err := decoder.Decode(&doc); err != nil {
		return fmt.Errorf("read input: %w", err)
	}
	fts := schedfeature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate)
	celFeatures := dracel.Features{
		EnableConsumableCapacity: fts.EnableDRAConsumableCapacity,
		EnableListTypeAttributes: fts.EnableDRAListTypeAttributes,
	}
	cache := dracel.NewCache(10, celFeatures)
	result := output{
		Features: dynamicresources.AllocatorFeatures(fts),
		Allocate: make([]allocateAnswer, 0, len(doc.Allocate)),
		CEL:      make([]celAnswer, 0, len(doc.CEL)),
	}
	for _, c := range doc.Allocate {
		result.Allocate = append(result.Allocate, allocate(c, result.Features, fts.EnableDRAConsumableCapacity, cache))
	}
	for _, c := range doc.CEL {
		result.CEL = append(result.CEL, evaluate(c, celFeatures, cache))
	}
	encoder := json.NewEncoder(out)
	return encoder.Encode(result)
}

func allocate(c allocateCase, fts structured.Features, consumableCapacity bool, cache *dracel.Cache) allocateAnswer {
	answer := allocateAnswer{ID: c.ID}
	ctx, cancel := context.WithTimeout(context.Background(), allocateTimeout)
	defer cancel()
	classes := classLister{}
	for _, class := range c.Classes {
		classes[class.Name] = class
	}
	state := allocatedState(c.Allocated, consumableCapacity)
	allocator, err := structured.NewAllocator(ctx, fts, state, classes, c.Slices, cache)
	if err != nil {
		answer.Error = err.Error()
		return answer
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: c.Node.Name, Labels: c.Node.Labels}}
	results, err := allocator.Allocate(ctx, node, c.Claims)
	switch {
	case errors.Is(err, structured.ErrFailedAllocationOnNode):
		answer.Unschedulable = err.Error()
	case err != nil:
		answer.Error = err.Error()
	default:
		answer.Allocations = results
	}
	return answer
}

// allocatedState is what the scheduler's claim tracker gathers from allocated claims
// (dynamicresources: foreachAllocatedDevice, GatherAllocatedState, ListAllAllocatedDevices):
// admin-access results hold nothing; with consumable capacity a result with a share ID holds
// its share and consumed capacity, every other result its whole device.
func allocatedState(claims []*resourceapi.ResourceClaim, consumableCapacity bool) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim.Status.Allocation == nil {
			continue
		}
		for _, result := range claim.Status.Allocation.Devices.Results {
			if ptr.Deref(result.AdminAccess, false) {
				continue
			}
			id := structured.MakeDeviceID(result.Driver, result.Pool, result.Device)
			if consumableCapacity && result.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, result.ShareID))
				if result.ConsumedCapacity != nil {
					state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, result.ConsumedCapacity))
				}
				continue
			}
			state.AllocatedDevices.Insert(id)
		}
	}
	return state
}

func evaluate(c celCase, fts dracel.Features, cache *dracel.Cache) celAnswer {
	answer := celAnswer{ID: c.ID, Results: []celResult{}}
	// What the API server's validation says of a new expression (pkg/apis/resource/validation:
	// validateCELExpression).
	newExpressions := environment.NewExpressions
	switch {
	case len(c.Expression) > resourceapi.CELSelectorExpressionMaxLength:
		answer.ValidationError = fmt.Sprintf("too long: must have at most %d bytes", resourceapi.CELSelectorExpressionMaxLength)
	default:
		validated := dracel.GetCompiler(fts).CompileCELExpression(c.Expression, dracel.Options{EnvType: &newExpressions})
		if validated.Error != nil {
			answer.ValidationError = validated.Error.Error()
		} else if validated.MaxCost > resourceapi.CELSelectorExpressionMaxCost {
			answer.ValidationError = "too complex, exceeds cost limit"
		}
	}
	// What the scheduler does with it (structured allocator: cache.GetOrCompile, DeviceMatches).
	compiled := cache.GetOrCompile(c.Expression)
	if compiled.Error != nil {
		answer.CompileError = compiled.Error.Error()
		return answer
	}
	for _, d := range c.Devices {
		matches, _, err := compiled.DeviceMatches(context.Background(), dracel.Device{
			Driver:                   d.Driver,
			AllowMultipleAllocations: d.AllowMultipleAllocations,
			Attributes:               d.Attributes,
			Capacity:                 d.Capacity,
		})
		if err != nil {
			answer.Results = append(answer.Results, celResult{Error: err.Error()})
			continue
		}
		answer.Results = append(answer.Results, celResult{Value: ptr.To(matches)})
	}
	return answer
}

// features is imported for its init: it registers Kubernetes' feature gates, with their
// defaults for this release, in utilfeature.DefaultFeatureGate.
var _ = features.DynamicResourceAllocation
