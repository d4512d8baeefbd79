//! Kernels whose SPIR-V we write ourselves: naga's WGSL front end and
//! validator, then its SPIR-V writer with the options wgpu-hal uses, then
//! one fix and one declaration, then the module goes to the driver as it is
//! (`create_shader_module_passthrough`), with a pipeline layout read from
//! naga's module where wgpu would have derived it.
//!
//! The fix: naga 30 writes WGSL's `subgroupBarrier()` as
//! `OpControlBarrier Subgroup Subgroup AcquireRelease|SubgroupMemory`,
//! which no storage class of Vulkan's is ordered by (spirv-val:
//! VUID-StandaloneSpirv-OpControlBarrier-04650). The kernels that use it
//! (the tensor-core attention's subgroup-local rows, `AttnTile::local`)
//! mean what `__syncwarp()` means: the subgroup's workgroup-memory accesses
//! ordered around it. So its semantics become AcquireRelease|WorkgroupMemory,
//! the semantics naga gives `workgroupBarrier()`, at subgroup scope.
//!
//! And one declaration: under the Vulkan memory model (which naga takes
//! for every module with cooperative matrices) naga writes storage-buffer
//! atomics at Device scope without the VulkanMemoryModelDeviceScope
//! capability that scope needs there (spirv-val: "Use of device scope with
//! VulkanKHR memory model requires the VulkanMemoryModelDeviceScopeKHR
//! capability"). The dk/dv kernels that add dQ with f32 atomics
//! (`AttnTile::fused_dq`) are such modules; the capability is declared
//! for them, and the device has it: wgpu-hal enables
//! vulkanMemoryModelDeviceScope wherever it enables cooperative matrices.

use naga::back::spv;
use naga::valid::{Capabilities, SubgroupOperationSet, ValidationFlags, Validator};

/// A compute kernel's SPIR-V and the interface a pipeline layout needs.
pub(crate) struct Compiled {
    pub words: Vec<u32>,
    /// Group 0's bindings the entry point uses: (binding, buffer type).
    pub bindings: Vec<(u32, wgpu::BufferBindingType)>,
    pub workgroup_size: [u32; 3],
}

const OP_CAPABILITY: u32 = 17;
const OP_MEMORY_MODEL: u32 = 14;
const MEMORY_MODEL_VULKAN: u32 = 3;
const CAP_VULKAN_MEMORY_MODEL_DEVICE_SCOPE: u32 = 5346;
const OP_CONSTANT: u32 = 43;
const OP_CONTROL_BARRIER: u32 = 224;
const SUBGROUP_MEMORY: u32 = 0x80;
const WORKGROUP_MEMORY: u32 = 0x100;

/// Compiles entry point `entry` of `src` as wgpu-hal would for a Vulkan
/// 1.3 device (per pipeline, with the runtime checks or without), then
/// gives its subgroup barriers workgroup-memory semantics and, under the
/// Vulkan memory model, declares device scope.
pub(crate) fn compile(src: &str, entry: &str, checked: bool) -> Result<Compiled, String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = Validator::new(ValidationFlags::all(), Capabilities::all())
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(SubgroupOperationSet::all())
        .validate(&module)
        .map_err(|e| e.emit_to_string(src))?;
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &Default::default(),
    )
    .map_err(|e| e.to_string())?;
    let ep_index = module
        .entry_points
        .iter()
        .position(|e| e.name == entry)
        .ok_or_else(|| format!("no entry point '{entry}'"))?;
    let ep = &module.entry_points[ep_index];
    let ep_info = info.get_entry_point(ep_index);
    let mut bindings = Vec::new();
    for (handle, var) in module.global_variables.iter() {
        let Some(rb) = &var.binding else { continue };
        if rb.group != 0 || ep_info[handle].is_empty() {
            continue;
        }
        let ty = match var.space {
            naga::AddressSpace::Uniform => wgpu::BufferBindingType::Uniform,
            naga::AddressSpace::Storage { access } => wgpu::BufferBindingType::Storage {
                read_only: !access.contains(naga::StorageAccess::STORE),
            },
            other => return Err(format!("binding {} in {other:?}: not a buffer", rb.binding)),
        };
        bindings.push((rb.binding, ty));
    }
    bindings.sort_by_key(|b| b.0);
    let workgroup_size = ep.workgroup_size;
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.into(),
    };
    // wgpu-hal numbers a layout's Vulkan bindings densely, in the order of
    // the WGSL bindings (wgpu-core sorts a layout's entries), and maps the
    // module's bindings onto them as it writes the SPIR-V; ours must do the
    // same, or a kernel that skips a binding number reads the wrong buffers
    // (`kernels_from_our_own_spirv_match_the_reference` shows it).
    let mut opts = options(checked);
    opts.fake_missing_bindings = false;
    opts.binding_map = bindings
        .iter()
        .enumerate()
        .map(|(i, &(binding, _))| {
            (
                naga::ResourceBinding { group: 0, binding },
                spv::BindingInfo {
                    descriptor_set: 0,
                    binding: i as u32,
                    binding_array_size: None,
                },
            )
        })
        .collect();
    let mut words = spv::write_vec(&module, &info, &opts, Some(&pipeline)).map_err(|e| e.to_string())?;
    subgroup_barriers_order_workgroup_memory(&mut words)?;
    declare_device_scope(&mut words)?;
    Ok(Compiled {
        words,
        bindings,
        workgroup_size,
    })
}

/// naga's SPIR-V options as wgpu-hal 30 sets them for a Vulkan 1.3 device
/// with robustBufferAccess2 (`Kernel::UNCHECKED` where not `checked`).
/// Workgroup memory is zeroed (WGSL's semantics) by the driver, as
/// wgpu-hal asks of a device whose shaderZeroInitializeWorkgroupMemory it
/// enabled, which Vulkan 1.3 requires of every device. naga's polyfill
/// instead stores one zero constant of the whole `Shared` struct: llvmpipe
/// had not finished compiling one attention kernel so after 16 minutes.
pub(crate) fn options(checked: bool) -> spv::Options<'static> {
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy::*};
    spv::Options {
        lang_version: (1, 6),
        bounds_check_policies: BoundsCheckPolicies {
            index: if checked { Restrict } else { Unchecked },
            buffer: Unchecked,
            image_load: Unchecked,
            binding_array: Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::Native,
        force_loop_bounding: checked,
        emit_int_div_checks: checked,
        ..Default::default()
    }
}

/// The instructions of a module: (word offset, opcode, word count).
fn instructions(words: &[u32]) -> Result<Vec<(usize, u32, usize)>, String> {
    let mut out = Vec::new();
    let mut at = 5;
    while at < words.len() {
        let (count, op) = ((words[at] >> 16) as usize, words[at] & 0xffff);
        if count == 0 || at + count > words.len() {
            return Err(format!("malformed SPIR-V at word {at}"));
        }
        out.push((at, op, count));
        at += count;
    }
    Ok(out)
}

/// Declares VulkanMemoryModelDeviceScope in a module under the Vulkan
/// memory model that does not (after its other capabilities). Returns
/// whether it did.
pub(crate) fn declare_device_scope(words: &mut Vec<u32>) -> Result<bool, String> {
    let ins = instructions(words)?;
    let vulkan = ins
        .iter()
        .any(|&(at, op, count)| op == OP_MEMORY_MODEL && count == 3 && words[at + 2] == MEMORY_MODEL_VULKAN);
    let caps: Vec<(usize, u32)> = ins
        .iter()
        .filter(|i| i.1 == OP_CAPABILITY && i.2 == 2)
        .map(|&(at, ..)| (at, words[at + 1]))
        .collect();
    if !vulkan || caps.iter().any(|c| c.1 == CAP_VULKAN_MEMORY_MODEL_DEVICE_SCOPE) {
        return Ok(false);
    }
    let after = caps.last().map_or(5, |c| c.0 + 2);
    words.splice(
        after..after,
        [(2 << 16) | OP_CAPABILITY, CAP_VULKAN_MEMORY_MODEL_DEVICE_SCOPE],
    );
    Ok(true)
}

/// Every `OpControlBarrier` whose semantics name SubgroupMemory gets
/// WorkgroupMemory in its place: a constant of that value (the same
/// integer type) found or added after the one it replaces. Returns the
/// barriers changed.
pub(crate) fn subgroup_barriers_order_workgroup_memory(words: &mut Vec<u32>) -> Result<usize, String> {
    if words.len() < 5 || words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module".into());
    }
    let ins = instructions(words)?;
    // id -> (type, value, offset) of every one-word integer constant.
    let mut constants = std::collections::HashMap::new();
    for &(at, op, count) in &ins {
        if op == OP_CONSTANT && count == 4 {
            constants.insert(words[at + 2], (words[at + 1], words[at + 3], at));
        }
    }
    let mut changed = 0;
    // (offset of the barrier's semantics operand, constant id wanted)
    let mut fixes = Vec::new();
    // New constants: (insert after offset, type, id, value).
    let mut added: Vec<(usize, u32, u32, u32)> = Vec::new();
    let mut bound = words[3];
    for &(at, op, count) in &ins {
        if op != OP_CONTROL_BARRIER || count != 4 {
            continue;
        }
        let sem_id = words[at + 3];
        let &(ty, sem, c_at) = constants
            .get(&sem_id)
            .ok_or_else(|| format!("barrier semantics %{sem_id} is not a constant"))?;
        if sem & SUBGROUP_MEMORY == 0 {
            continue;
        }
        let want = (sem & !SUBGROUP_MEMORY) | WORKGROUP_MEMORY;
        let id = match constants
            .iter()
            .find(|(_, (t, v, _))| *t == ty && *v == want)
            .map(|(id, _)| *id)
            .or_else(|| added.iter().find(|a| a.1 == ty && a.3 == want).map(|a| a.2))
        {
            Some(id) => id,
            None => {
                let id = bound;
                bound += 1;
                added.push((c_at, ty, id, want));
                id
            }
        };
        fixes.push((at + 3, id));
        changed += 1;
    }
    for (at, id) in fixes {
        words[at] = id;
    }
    // Inserted last first, so earlier offsets stay right.
    added.sort_by_key(|a| std::cmp::Reverse(a.0));
    for (c_at, ty, id, value) in added {
        let after = c_at + 4;
        words.splice(after..after, [(4 << 16) | OP_CONSTANT, ty, id, value]);
    }
    words[3] = bound;
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = "
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<storage, read> inp: array<u32>;
@group(0) @binding(5) var<uniform> n: vec4<u32>;
@group(0) @binding(3) var<storage, read> unused: array<u32>;
var<workgroup> s: array<u32, 64>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(local_invocation_index) li: u32) {
    s[li] = inp[li] + n.x;
    subgroupBarrier();
    workgroupBarrier();
    subgroupBarrier();
    out[li] = s[li ^ 1u];
}
";

    /// (execution scope, memory scope, semantics) of every barrier.
    fn barriers(words: &[u32]) -> Vec<(u32, u32, u32)> {
        let ins = instructions(words).unwrap();
        let value = |id: u32| {
            ins.iter()
                .find(|&&(at, op, count)| op == OP_CONSTANT && count == 4 && words[at + 2] == id)
                .map(|&(at, ..)| words[at + 3])
                .unwrap()
        };
        ins.iter()
            .filter(|i| i.1 == OP_CONTROL_BARRIER)
            .map(|&(at, ..)| (value(words[at + 1]), value(words[at + 2]), value(words[at + 3])))
            .collect()
    }

    /// The values of every `OpDecorate … Binding` (sorted).
    fn binding_decorations(words: &[u32]) -> Vec<u32> {
        const OP_DECORATE: u32 = 71;
        const BINDING: u32 = 33;
        let mut v: Vec<u32> = instructions(words)
            .unwrap()
            .into_iter()
            .filter(|&(at, op, count)| op == OP_DECORATE && count == 4 && words[at + 2] == BINDING)
            .map(|(at, ..)| words[at + 3])
            .collect();
        v.sort();
        v
    }

    #[test]
    fn subgroup_barriers_order_workgroup_memory_and_nothing_else_changes() {
        let c = compile(SRC, "main", false).unwrap();
        assert_eq!(c.workgroup_size, [64, 1, 1]);
        let ro = |read_only| wgpu::BufferBindingType::Storage { read_only };
        assert_eq!(
            c.bindings,
            vec![
                (0, ro(false)),
                (1, ro(true)),
                (5, wgpu::BufferBindingType::Uniform)
            ]
        );
        // As wgpu-hal numbers the layout's Vulkan bindings: densely.
        assert_eq!(binding_decorations(&c.words), [0, 1, 2]);
        // Subgroup = 3, Workgroup = 2; AcquireRelease 0x8 | WorkgroupMemory 0x100.
        assert_eq!(barriers(&c.words), [(3, 3, 0x108), (2, 2, 0x108), (3, 3, 0x108)]);
        // Idempotent, and a second pass finds nothing to do.
        let mut again = c.words.clone();
        assert_eq!(subgroup_barriers_order_workgroup_memory(&mut again), Ok(0));
        assert_eq!(again, c.words);
    }

    #[test]
    fn a_constant_that_is_missing_is_added_once() {
        // Only subgroup barriers: no 0x108 constant until the fix adds one.
        let src = SRC.replace("    workgroupBarrier();\n", "");
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let info = Validator::new(ValidationFlags::all(), Capabilities::all())
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(SubgroupOperationSet::all())
            .validate(&module)
            .unwrap();
        let mut opts = options(false);
        opts.zero_initialize_workgroup_memory = spv::ZeroInitializeWorkgroupMemoryMode::None;
        let mut words = spv::write_vec(&module, &info, &opts, None).unwrap();
        let bound = words[3];
        assert_eq!(barriers(&words), [(3, 3, 0x88), (3, 3, 0x88)]);
        assert_eq!(subgroup_barriers_order_workgroup_memory(&mut words), Ok(2));
        assert_eq!(barriers(&words), [(3, 3, 0x108), (3, 3, 0x108)]);
        assert_eq!(words[3], bound + 1);
        assert!(instructions(&words).is_ok());
    }

    /// A module with cooperative matrices (so the Vulkan memory model) and
    /// a storage atomic gets the device-scope capability, once; one
    /// without either gets nothing.
    #[test]
    fn device_scope_is_declared_under_the_vulkan_memory_model_only() {
        let coop = "enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> acc: array<atomic<f32>>;
var<workgroup> s: array<f16, 256>;
var<workgroup> t: array<f32, 256>;
@compute @workgroup_size(32, 1, 1)
fn main(@builtin(local_invocation_index) li: u32) {
    let i = 0u;
    let n = 16u;
    let a = coopLoad<coop_mat16x16<f16, A>>(&s[i], n);
    let b = coopLoad<coop_mat16x16<f16, B>>(&s[i], n);
    let c = coopMultiplyAdd(a, b, coop_mat16x16<f32, C>());
    coopStore(c, &t[i], n);
    workgroupBarrier();
    atomicAdd(&acc[li], t[li]);
}
";
        let has = |w: &[u32]| {
            instructions(w)
                .unwrap()
                .iter()
                .filter(|&&(at, op, _)| {
                    op == OP_CAPABILITY && w[at + 1] == CAP_VULKAN_MEMORY_MODEL_DEVICE_SCOPE
                })
                .count()
        };
        let c = compile(coop, "main", false).unwrap();
        assert_eq!(has(&c.words), 1);
        let mut again = c.words.clone();
        assert_eq!(declare_device_scope(&mut again), Ok(false));
        let plain = compile(SRC, "main", false).unwrap();
        assert_eq!(has(&plain.words), 0);
    }

    #[test]
    fn not_spirv_is_refused() {
        let mut w = vec![1, 2, 3];
        assert!(subgroup_barriers_order_workgroup_memory(&mut w).is_err());
    }
}
