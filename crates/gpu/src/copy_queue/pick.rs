//! Which queue a device is opened with for its copies.

use ash::vk;

use super::CopyQueueChoice;

/// The queue a device is opened with for copies, chosen before it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueuePick {
    pub family: u32,
    pub index: u32,
    /// What it is, for reports.
    pub what: &'static str,
}

/// The queue for `choice` on the physical device: a transfer-only
/// family (copy engines) before any other family, a second queue of
/// wgpu's family (0) last. `None` without timeline semaphores
/// (Vulkan 1.2), which the synchronization needs.
pub(crate) fn pick(
    instance: &ash::Instance,
    phd: vk::PhysicalDevice,
    choice: CopyQueueChoice,
) -> Option<QueuePick> {
    // SAFETY: queries of a physical device the adapter holds.
    unsafe {
        if instance.get_physical_device_properties(phd).api_version < vk::API_VERSION_1_2 {
            return None;
        }
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v12);
        instance.get_physical_device_features2(phd, &mut f2);
        if v12.timeline_semaphore == vk::FALSE {
            return None;
        }
        let families = instance.get_physical_device_queue_family_properties(phd);
        match choice {
            CopyQueueChoice::Off => None,
            CopyQueueChoice::Shared => Some(QueuePick {
                family: 0,
                index: 0,
                what: "wgpu's own queue (shared)",
            }),
            CopyQueueChoice::Auto => {
                let rank = |f: &vk::QueueFamilyProperties| {
                    let busy = vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE;
                    (f.queue_flags & busy).as_raw().count_ones()
                };
                let other = families
                    .iter()
                    .enumerate()
                    .skip(1)
                    .filter(|(_, f)| f.queue_flags.contains(vk::QueueFlags::TRANSFER) && f.queue_count > 0)
                    .min_by_key(|(_, f)| rank(f));
                match other {
                    Some((i, f)) => Some(QueuePick {
                        family: i as u32,
                        index: 0,
                        what: if rank(f) == 0 {
                            "a transfer-only queue family"
                        } else {
                            "a second queue family"
                        },
                    }),
                    None if families.first().is_some_and(|f| f.queue_count >= 2) => Some(QueuePick {
                        family: 0,
                        index: 1,
                        what: "a second queue of wgpu's family",
                    }),
                    None => None,
                }
            }
        }
    }
}

/// Queue priorities that outlive the device's creation.
static ONE: [f32; 1] = [1.0];
static TWO: [f32; 2] = [1.0, 1.0];

/// Adds `pick`'s queue to the device wgpu-hal is about to create
/// (wgpu's own is family 0, index 0).
pub(crate) fn add_queue(pick: QueuePick, infos: &mut Vec<vk::DeviceQueueCreateInfo<'_>>) {
    match (pick.family, pick.index) {
        (0, 0) => {}
        (0, _) => {
            if let Some(info) = infos.iter_mut().find(|i| i.queue_family_index == 0) {
                *info = info.queue_priorities(&TWO);
            }
        }
        (f, _) => infos.push(
            vk::DeviceQueueCreateInfo::default()
                .queue_family_index(f)
                .queue_priorities(&ONE),
        ),
    }
}
