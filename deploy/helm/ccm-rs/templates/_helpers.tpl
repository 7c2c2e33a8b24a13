{{- define "ccm-rs.labels" -}}
app.kubernetes.io/part-of: ccm-rs
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "ccm-rs.image" -}}
{{ .image.repository }}:{{ .image.tag | default .appVersion }}
{{- end -}}

{{/* The core Deployment's name (and its pods' app.kubernetes.io/name). */}}
{{- define "ccm-rs.fullname" -}}
{{- if .Values.fullnameOverride }}{{ .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}{{ .Values.nameOverride | default "cloud-controller-manager" | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end -}}

{{/* The Pod's ServiceAccount (the core and the provider sidecar run as it). */}}
{{- define "ccm-rs.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default "cloud-controller-manager" -}}
{{- end -}}

{{/* The provider sidecar: the sim's when sim.enabled, else provider.*, which must be set. */}}
{{- define "ccm-rs.provider" -}}
{{- if .Values.sim.enabled -}}
name: sim.cloudprovider.dev
image: {{ toYaml .Values.sim.image | nindent 2 }}
args:
  - --config=/etc/ccm-provider/sim.toml
  - --metadata-listen=http://$(POD_IP):8169
  {{- with .Values.sim.extraArgs }}{{ toYaml . | nindent 2 }}{{ end }}
config: {{ toYaml .Values.sim.config | nindent 2 }}
{{- else -}}
{{- if not .Values.provider.image.repository -}}
{{- fail "no provider chosen: set provider.image.repository (and provider.name, provider.args) to your cloud's cloudprovider.v1 sidecar, or sim.enabled=true to try the simulated cloud (not for real clusters)" -}}
{{- end -}}
name: {{ required "provider.name is required (the provider's plugin name, for example mycloud.example.com)" .Values.provider.name }}
image: {{ toYaml .Values.provider.image | nindent 2 }}
args: {{ toYaml .Values.provider.args | nindent 2 }}
config: {{ toYaml .Values.provider.config | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The node plugin's image and arguments: given, else the sim's. */}}
{{- define "ccm-rs.nodePlugin" -}}
{{- if .Values.nodeMetadata.image.repository -}}
image: {{ toYaml .Values.nodeMetadata.image | nindent 2 }}
args: {{ toYaml .Values.nodeMetadata.args | nindent 2 }}
{{- else if .Values.sim.enabled -}}
image: {{ toYaml .Values.sim.image | nindent 2 }}
args:
  - node-metadata
  # No cluster DNS before Nodes are initialised: the metadata Service's address from the
  # variables the kubelet gives every pod (a real cloud's plugin reads its link-local service).
  - --metadata-endpoint=http://$(CCM_PROVIDER_SIM_METADATA_SERVICE_HOST):$(CCM_PROVIDER_SIM_METADATA_SERVICE_PORT)
{{- else -}}
{{- fail "nodeMetadata.enabled: set nodeMetadata.image.repository and nodeMetadata.args to your provider's node plugin, or nodeMetadata.enabled=false" -}}
{{- end -}}
{{- end -}}

{{/* The controllers' own ServiceAccounts, upstream's names (the core's default
--service-account-names=upstream), and what each does: node-controller for the node and node
lifecycle controllers, route-controller, service-controller. */}}
{{- define "ccm-rs.controllerRules" -}}
node-controller:
  - {apiGroups: [""], resources: [nodes], verbs: [get, patch, delete]}
  - {apiGroups: [""], resources: [nodes/status], verbs: [patch]}
route-controller:
  - {apiGroups: [""], resources: [nodes/status], verbs: [patch]}
service-controller:
  - {apiGroups: [""], resources: [services], verbs: [get, patch]}
  - {apiGroups: [""], resources: [services/status], verbs: [patch]}
  # The Services' pod endpoints, watched only when the provider forwards to pods
  # (LoadBalancersCapabilities.pod_endpoints).
  - {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
{{- end -}}

{{/* Every Lease the core may hold: the main one, one per controller
(leaderElection.perController), and the leader migration one (its config's leaderName).
The same names whatever the values, so that switching a value needs no new RBAC. */}}
{{- define "ccm-rs.leaseNames" -}}
{{- $names := list "cloud-controller-manager" "cloud-controller-manager-cloud-node-controller" "cloud-controller-manager-cloud-node-lifecycle-controller" "cloud-controller-manager-node-route-controller" "cloud-controller-manager-service-lb-controller" "cloud-controller-manager-node-ipam-controller" "cloud-controller-manager-tagging-controller" "cloud-provider-extraction-migration" "cloud-controller-manager-member-0" "cloud-controller-manager-member-1" "cloud-controller-manager-member-2" "cloud-controller-manager-member-3" "cloud-controller-manager-member-4" "cloud-controller-manager-member-5" "cloud-controller-manager-member-6" "cloud-controller-manager-member-7" -}}
{{- with .Values.leaderMigration.config -}}
{{- $config := . | fromYaml -}}
{{- if and $config.leaderName (not (has $config.leaderName $names)) -}}
{{- $names = append $names $config.leaderName -}}
{{- end -}}
{{- end -}}
{{- join ", " $names -}}
{{- end -}}

{{/* Every provider sidecar in the pod, as a list under `providers`: the first is provider.*
(or the sim), then extraProviders. Each: name (its --provider-endpoint name), container, uid
(its own user), metrics (served again by the core), account (its own ServiceAccount),
annotations, rules (its reads, by its own account), and the rest of its item. */}}
{{- define "ccm-rs.providers" -}}
{{- $fullname := include "ccm-rs.fullname" . -}}
{{- $p := .Values.provider -}}
providers:
  - name: {{ $p.endpointName }}
    container: provider
    config: ccm-provider-config
    uid: {{ $p.runAsUser | int }}
    metrics: {{ ($p.metrics | default dict).enabled | default false }}
    account: {{ ($p.serviceAccount | default dict).name | default (printf "%s-provider" $fullname) }}
    annotations: {{ toYaml (($p.serviceAccount | default dict).annotations | default dict) | nindent 6 }}
    rules: {{ toYaml (($p.rbac | default dict).rules | default list) | nindent 6 }}
{{- range $i, $e := .Values.extraProviders }}
  - name: {{ $e.name }}
    container: provider-{{ $e.name }}
    config: ccm-provider-config-{{ $e.name }}
    uid: {{ $e.runAsUser | default (add 65540 $i) | int }}
    metrics: {{ ($e.metrics | default dict).enabled | default false }}
    account: {{ ($e.serviceAccount | default dict).name | default (printf "%s-provider-%s" $fullname $e.name) }}
    annotations: {{ toYaml (($e.serviceAccount | default dict).annotations | default dict) | nindent 6 }}
    rules: {{ toYaml (($e.rbac | default dict).rules | default list) | nindent 6 }}
{{- end }}
{{- end -}}
