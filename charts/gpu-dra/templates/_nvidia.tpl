{{/*
Values written for NVIDIA's chart (k8s-dra-driver-gpu v0.5), turned into this chart's own.
docs/migration.md "A values file written for NVIDIA's chart" has the table, key by key.

"gpu-dra.nvidiaValues" rewrites .Values in place, once per render (the same map reaches every
template, whichever renders first), so the templates read only this chart's keys. Where an
NVIDIA key is set, it wins over this chart's key of the same meaning. Keys with no equivalent
are accepted and named in NOTES ("gpu-dra.nvidiaIgnored"); keys this driver cannot honour stop
the install with a message saying what to use instead.
*/}}

{{- define "gpu-dra.nvidiaValues" -}}
{{- $v := .Values }}
{{- if not (hasKey $v "_nvidiaApplied") }}
{{- $_ := set $v "_nvidiaApplied" true }}
{{- if $v.nvidiaCDIHookPath }}
{{- $_ := set $v "cdiHook" $v.nvidiaCDIHookPath }}
{{- end }}
{{- if eq (toString $v.consumableShares) "" }}
{{- $_ := set $v "consumableShares" "disabled" }}
{{- end }}
{{- with $v.resources }}
{{- if and (hasKey . "gpus") (not (dig "enabled" true .gpus)) }}
{{- fail "resources.gpus.enabled=false (NVIDIA's chart): gpu-dra is the GPU part of NVIDIA's driver only; to run only ComputeDomains, install NVIDIA's chart instead (or uninstall gpu-dra)" }}
{{- end }}
{{- end }}
{{- $gates := $v.featureGates | default dict }}
{{- if hasKey $gates "DynamicMIG" }}
{{- $_ := set $v.mig "mode" (ternary "dynamic" "static" (index $gates "DynamicMIG")) }}
{{- end }}
{{- if hasKey $gates "MPSSupport" }}
{{- $_ := set $v.mps "enabled" (index $gates "MPSSupport") }}
{{- end }}
{{- if and (hasKey $gates "ConsumableShares") (not (index $gates "ConsumableShares")) (ne (toString $v.consumableShares) "disabled") }}
{{- fail (printf "featureGates.ConsumableShares=false contradicts consumableShares=%v: set consumableShares to disabled, or the gate to true" $v.consumableShares) }}
{{- end }}
{{- with $v.logVerbosity }}
{{- if not (regexMatch "^[0-9]+$" (toString .)) }}
{{- fail (printf "logVerbosity=%v (NVIDIA's chart): use a klog verbosity, a number 0 or greater, or logLevel" .) }}
{{- end }}
{{- $_ := set $v "logLevel" (ternary "debug" "info" (ge (atoi (toString .)) 6)) }}
{{- end }}
{{- $p := $v.kubeletPlugin }}
{{- with $p.kubeletRegistrarDirectoryPath }}
{{- $_ := set $v "kubeletRegistrarDirectoryPath" . }}
{{- end }}
{{- with $p.kubeletPluginsDirectoryPath }}
{{- $_ := set $v "kubeletPluginsDirectoryPath" . }}
{{- end }}
{{- with $p.updateStrategy }}
{{- if eq (.type | default "RollingUpdate") "RollingUpdate" }}
{{- $ru := deepCopy $p.rollingUpdate }}
{{- range $key, $value := (.rollingUpdate | default dict) }}
{{- $_ := set $ru $key $value }}
{{- end }}
{{- $_ := set $p "rollingUpdate" $ru }}
{{- else if ne .type "OnDelete" }}
{{- fail (printf "kubeletPlugin.updateStrategy.type=%v: use RollingUpdate or OnDelete" .type) }}
{{- end }}
{{- end }}
{{- with $p.metrics }}
{{- if .enabled }}
{{- $endpoint := toString (.gpuHttpEndpoint | default ":8080") }}
{{- if not (regexMatch "^[^:]*:[0-9]+$" $endpoint) }}
{{- fail (printf "kubeletPlugin.metrics.gpuHttpEndpoint=%v: use [host]:port; gpu-dra serves /metrics on metricsPort" $endpoint) }}
{{- end }}
{{- $_ := set $v "metricsPort" (atoi (regexFind "[0-9]+$" $endpoint)) }}
{{- end }}
{{- if not (has (.metricsPath | default "/metrics") (list "/metrics" "/metrics/")) }}
{{- fail (printf "kubeletPlugin.metrics.metricsPath=%v: gpu-dra serves its metrics on /metrics only; point the scrape at /metrics" .metricsPath) }}
{{- end }}
{{- end }}
{{- $g := dig "containers" "gpus" dict $p }}
{{- with $g.securityContext }}
{{- $sc := deepCopy $p.securityContext }}
{{- range $key, $value := . }}
{{- $_ := set $sc $key $value }}
{{- end }}
{{- $_ := set $p "securityContext" $sc }}
{{- end }}
{{- with $g.resources }}
{{- $_ := set $p "resources" (deepCopy .) }}
{{- end }}
{{- if hasKey $g "healthcheckPort" }}
{{- if le (int $g.healthcheckPort) 0 }}
{{- fail (printf "kubeletPlugin.containers.gpus.healthcheckPort=%v: gpu-dra's probes need a port (1-65535); NVIDIA's negative value switches its gRPC probe off, gpu-dra's HTTP probes stay on" $g.healthcheckPort) }}
{{- end }}
{{- $_ := set $v "healthcheckPort" (int $g.healthcheckPort) }}
{{- end }}
{{- with $g.env }}
{{- $_ := set $p "extraEnv" (concat (list) $p.extraEnv .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* NVIDIA's keys given in the values that have no effect here, one "key: why" per line. */}}
{{- define "gpu-dra.nvidiaIgnored" -}}
{{- $v := .Values }}
{{- if hasKey $v "gpuResourcesEnabledOverride" }}
gpuResourcesEnabledOverride: GPUs are what gpu-dra serves; nothing to override
{{- end }}
{{- if hasKey $v "allowDefaultNamespace" }}
allowDefaultNamespace: gpu-dra installs into any namespace, "default" included
{{- end }}
{{- if hasKey $v "maskNvidiaDriverParams" }}
maskNvidiaDriverParams: gpu-dra never creates GPU device nodes of GPUs it does not serve
{{- end }}
{{- with $v.resources }}
{{- if hasKey . "computeDomains" }}
resources.computeDomains: ComputeDomains (IMEX) are not served by gpu-dra; run NVIDIA's chart beside it with resources.gpus.enabled=false for them
{{- end }}
{{- end }}
{{- if hasKey $v "controller" }}
controller: the ComputeDomain controller is NVIDIA's; gpu-dra has no controller
{{- end }}
{{- range $gate, $on := ($v.featureGates | default dict) }}
{{- if not (has $gate (list "DynamicMIG" "MPSSupport" "ConsumableShares")) }}
featureGates.{{ $gate }}: {{ include "gpu-dra.nvidiaGateNote" $gate }}
{{- end }}
{{- end }}
{{- with $v.kubeletPlugin }}
{{- if hasKey . "networkPolicy" }}
kubeletPlugin.networkPolicy: no NetworkPolicy is rendered; the agent listens only on its probe and metrics ports
{{- end }}
{{- with .containers }}
{{- if hasKey . "init" }}
kubeletPlugin.containers.init: gpu-dra runs no init container
{{- end }}
{{- if hasKey . "computeDomains" }}
kubeletPlugin.containers.computeDomains: ComputeDomains are not served by gpu-dra
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpu-dra.nvidiaGateNote" -}}
{{- if has . (list "TimeSlicingSettings") -}}
time-slicing settings are always accepted by gpu-dra
{{- else if has . (list "NVMLDeviceHealthCheck" "DeviceHealthCheck") -}}
GPU health checks are always on in gpu-dra (health.* values; health.taintEffect=None to only report)
{{- else if has . (list "DRAListTypeAttributes") -}}
gpu-dra publishes no list-type attributes
{{- else -}}
no effect in gpu-dra (ComputeDomain, IMEX or klog option of NVIDIA's driver)
{{- end -}}
{{- end }}

{{/* featureGates as NVIDIA's chart passes FEATURE_GATES: Name=true,Other=false */}}
{{- define "gpu-dra.featureGates" -}}
{{- $parts := list }}
{{- range $gate, $on := . }}{{ $parts = append $parts (printf "%s=%t" $gate $on) }}{{ end }}
{{- join "," $parts }}
{{- end }}

{{/* The namespace of every namespaced object: NVIDIA's namespaceOverride, else the release's. */}}
{{- define "gpu-dra.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace }}
{{- end }}
